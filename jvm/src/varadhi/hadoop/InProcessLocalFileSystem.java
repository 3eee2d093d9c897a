package varadhi.hadoop;

import org.apache.hadoop.fs.LocalFileSystem;

/**
 * {@code fs.file.impl}: Hadoop's checksummed local file system ({@link LocalFileSystem}) over
 * {@link InProcessRawLocalFileSystem}, which starts no {@code chmod} process.
 */
public class InProcessLocalFileSystem extends LocalFileSystem {
  public InProcessLocalFileSystem() {
    super(new InProcessRawLocalFileSystem());
  }
}
