package varadhi.hadoop;

import java.io.IOException;
import java.nio.file.Files;
import java.nio.file.attribute.PosixFilePermission;
import java.util.EnumSet;
import java.util.Set;
import org.apache.hadoop.fs.FileStatus;
import org.apache.hadoop.fs.Path;
import org.apache.hadoop.fs.RawLocalFileSystem;
import org.apache.hadoop.fs.permission.FsPermission;
import org.apache.hadoop.io.nativeio.NativeIO;

/**
 * Hadoop's raw local file system, but a permission is set, and a path that is not a symbolic link
 * is looked at, in the JVM (java.nio) rather than by a {@code chmod} or {@code readlink} child
 * process.
 *
 * <p>Without Hadoop's native library (pip's pyspark has none), {@link RawLocalFileSystem} sets the
 * permission of every file it creates (checkpoint, state store, Delta log and data files, and their
 * .crc files) by starting {@code chmod}. That child is in the driver's process group and systemd
 * unit, so a Ctrl-C or a SIGTERM to the group kills it too, the write fails and so does the
 * streaming query: a stop becomes a failure. With the native library present, or for a mode java.nio
 * cannot express (the sticky bit), Hadoop's own way is kept.
 */
public class InProcessRawLocalFileSystem extends RawLocalFileSystem {
  private static final PosixFilePermission[] BITS = {
    PosixFilePermission.OTHERS_EXECUTE, PosixFilePermission.OTHERS_WRITE,
    PosixFilePermission.OTHERS_READ, PosixFilePermission.GROUP_EXECUTE,
    PosixFilePermission.GROUP_WRITE, PosixFilePermission.GROUP_READ,
    PosixFilePermission.OWNER_EXECUTE, PosixFilePermission.OWNER_WRITE,
    PosixFilePermission.OWNER_READ,
  };

  /** The java.nio permissions of a mode's lowest nine bits (rwxrwxrwx). */
  static Set<PosixFilePermission> posix(short mode) {
    Set<PosixFilePermission> perms = EnumSet.noneOf(PosixFilePermission.class);
    for (int bit = 0; bit < BITS.length; bit++) {
      if ((mode & (1 << bit)) != 0) {
        perms.add(BITS[bit]);
      }
    }
    return perms;
  }

  @Override
  public void setPermission(Path p, FsPermission permission) throws IOException {
    short mode = permission.toShort();
    if (NativeIO.isAvailable() || (mode & ~0777) != 0) {
      super.setPermission(p, permission);
      return;
    }
    Files.setPosixFilePermissions(pathToFile(p).toPath(), posix(mode));
  }

  /**
   * Hadoop's answer, without its {@code readlink} child process for a path that is not a symbolic
   * link. {@link RawLocalFileSystem#getFileLinkStatus} starts {@code readlink} at every call, and
   * FileContext's rename calls it for the source and the target of every file it renames: each
   * streaming checkpoint entry (offsets, commits) and each Delta log commit, with their .crc files.
   * On 2 cores that was about 27 ms of every streaming metadata-log entry, two per micro-batch. For
   * a path that is not a link Hadoop returns {@link #getFileStatus}, and so does this (a missing
   * path: FileNotFoundException, as there). A link still goes Hadoop's way.
   */
  @Override
  public FileStatus getFileLinkStatus(Path f) throws IOException {
    if (Files.isSymbolicLink(pathToFile(f).toPath())) {
      return super.getFileLinkStatus(f);
    }
    return getFileStatus(f);
  }
}
