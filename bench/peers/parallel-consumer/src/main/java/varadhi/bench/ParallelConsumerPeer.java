package varadhi.bench;

import io.confluent.parallelconsumer.ParallelConsumerOptions;
import io.confluent.parallelconsumer.ParallelConsumerOptions.ProcessingOrder;
import io.confluent.parallelconsumer.PollContext;
import io.confluent.parallelconsumer.vertx.VertxParallelEoSStreamProcessor;
import io.vertx.core.Future;
import io.vertx.core.buffer.Buffer;
import io.vertx.ext.web.client.HttpRequest;
import io.vertx.ext.web.client.HttpResponse;
import io.vertx.ext.web.client.WebClient;
import java.lang.management.ManagementFactory;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.time.Duration;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import java.util.Properties;
import java.util.concurrent.atomic.AtomicLong;
import java.util.stream.Collectors;
import org.apache.kafka.clients.admin.Admin;
import org.apache.kafka.clients.admin.AdminClientConfig;
import org.apache.kafka.clients.admin.OffsetSpec;
import org.apache.kafka.clients.consumer.ConsumerConfig;
import org.apache.kafka.clients.consumer.ConsumerRecord;
import org.apache.kafka.clients.consumer.KafkaConsumer;
import org.apache.kafka.clients.consumer.OffsetAndMetadata;
import org.apache.kafka.common.TopicPartition;
import org.apache.kafka.common.header.Header;
import org.apache.kafka.common.serialization.ByteArrayDeserializer;

/**
 * What a user who picks Confluent Parallel Consumer instead of varadhi would write: consume a topic
 * in key order with up to {@code --max-concurrency} records in flight, POST each record's value
 * to {@code --url} with the headers a varadhi shard sends, and let Parallel Consumer retry a
 * failed delivery (connection error or non-2xx answer) after {@code --retry-delay-ms}, with no
 * limit on attempts.
 *
 * <p>Arguments: {@code --bootstrap HOST:PORT --topic T --group G --url URL [--max-concurrency 64]
 * [--retry-delay-ms 1000] [--stop-when-idle 3] [--report FILE]}.
 *
 * <p>It stops once it is drained, as a shard's {@code --stop-when-idle}: the group's committed
 * offsets have reached the topic's end offsets, no record is left in Parallel Consumer, and that
 * has held for {@code --stop-when-idle} seconds. It then writes a JSON report (deliveries,
 * failures, the process's CPU seconds) to {@code --report} and to stdout. Exit code 1 if
 * Parallel Consumer failed.
 */
public final class ParallelConsumerPeer {

    /** An answer outside 2xx: Parallel Consumer retries the record. No stack trace (it is expected). */
    static final class StatusFailure extends RuntimeException {
        StatusFailure(int status) {
            super("HTTP " + status, null, false, false);
        }
    }

    private final AtomicLong delivered = new AtomicLong();
    private final AtomicLong failed = new AtomicLong();
    private final String url;

    private ParallelConsumerPeer(String url) {
        this.url = url;
    }

    public static void main(String[] argv) throws Exception {
        Map<String, String> args = parse(argv);
        String bootstrap = required(args, "bootstrap");
        String topic = required(args, "topic");
        String group = required(args, "group");
        int maxConcurrency = Integer.parseInt(args.getOrDefault("max-concurrency", "64"));
        long retryDelayMs = Long.parseLong(args.getOrDefault("retry-delay-ms", "1000"));
        double idleS = Double.parseDouble(args.getOrDefault("stop-when-idle", "3"));
        long startedMs = System.currentTimeMillis();

        Properties props = new Properties();
        props.put(ConsumerConfig.BOOTSTRAP_SERVERS_CONFIG, bootstrap);
        props.put(ConsumerConfig.GROUP_ID_CONFIG, group);
        props.put(ConsumerConfig.ENABLE_AUTO_COMMIT_CONFIG, "false"); // Parallel Consumer commits
        props.put(ConsumerConfig.AUTO_OFFSET_RESET_CONFIG, "earliest");
        KafkaConsumer<byte[], byte[]> consumer =
                new KafkaConsumer<>(props, new ByteArrayDeserializer(), new ByteArrayDeserializer());
        ParallelConsumerOptions<byte[], byte[]> options = ParallelConsumerOptions.<byte[], byte[]>builder()
                .consumer(consumer)
                .ordering(ProcessingOrder.KEY)
                .maxConcurrency(maxConcurrency)
                .defaultMessageRetryDelay(Duration.ofMillis(retryDelayMs))
                .build();
        VertxParallelEoSStreamProcessor<byte[], byte[]> pc = new VertxParallelEoSStreamProcessor<>(options);

        ParallelConsumerPeer peer = new ParallelConsumerPeer(required(args, "url"));
        pc.subscribe(List.of(topic));
        pc.vertxHttpWebClient(peer::deliver, sent -> { });

        boolean ok;
        try (Admin admin = Admin.create(Map.of(AdminClientConfig.BOOTSTRAP_SERVERS_CONFIG, bootstrap))) {
            ok = waitUntilDrained(pc, admin, topic, group, idleS);
        }
        pc.close();
        long cpuNs = ManagementFactory.getPlatformMXBean(com.sun.management.OperatingSystemMXBean.class)
                .getProcessCpuTime();
        String report = String.format(
                "{\"delivered\": %d, \"failed_attempts\": %d, \"cpu_s\": %.3f, \"wall_s\": %.3f, \"ok\": %b}%n",
                peer.delivered.get(), peer.failed.get(), cpuNs / 1e9,
                (System.currentTimeMillis() - startedMs) / 1e3, ok);
        System.out.print(report);
        if (args.containsKey("report")) {
            Files.writeString(Path.of(args.get("report")), report);
        }
        System.exit(ok ? 0 : 1);
    }

    /** One record's delivery: a failed future (connection error, non-2xx) makes Parallel Consumer retry it. */
    private Future<HttpResponse<Buffer>> deliver(WebClient client, PollContext<byte[], byte[]> context) {
        ConsumerRecord<byte[], byte[]> record = context.getSingleConsumerRecord();
        String msgId = header(record, "varadhi-msg-id");
        if (msgId == null) {
            msgId = record.topic() + "-" + record.partition() + "-" + record.offset();
        }
        int attempt = context.getSingleRecord().getNumberOfFailedAttempts() + 1;
        HttpRequest<Buffer> request = client.postAbs(url)
                .putHeader("Content-Type", "application/octet-stream")
                .putHeader("X-Varadhi-Message-Id", msgId)
                .putHeader("Idempotency-Key", msgId)
                .putHeader("X-Varadhi-Attempt", Integer.toString(attempt))
                .putHeader("X-Varadhi-Source", record.topic() + "/" + record.partition() + "/" + record.offset());
        String groupId = header(record, "varadhi-group-id");
        if (groupId != null) {
            request.putHeader("X-Varadhi-Group-Id", groupId);
        }
        String producedMs = header(record, "varadhi-produced-ms");
        if (producedMs != null) {
            request.putHeader("X-Varadhi-Produced-At", producedMs);
        }
        return request.sendBuffer(Buffer.buffer(record.value())).compose(response -> {
            if (response.statusCode() / 100 == 2) {
                delivered.incrementAndGet();
                return Future.succeededFuture(response);
            }
            failed.incrementAndGet();
            return Future.failedFuture(new StatusFailure(response.statusCode()));
        }, error -> {
            failed.incrementAndGet();
            return Future.failedFuture(error);
        });
    }

    /**
     * Polls every 0.5 s until the group is drained (see the class comment) for {@code idleS} seconds;
     * false if Parallel Consumer failed first.
     */
    private static boolean waitUntilDrained(
            VertxParallelEoSStreamProcessor<byte[], byte[]> pc, Admin admin, String topic, String group, double idleS)
            throws Exception {
        List<TopicPartition> partitions = admin.describeTopics(List.of(topic)).allTopicNames().get().get(topic)
                .partitions().stream().map(p -> new TopicPartition(topic, p.partition())).toList();
        Map<TopicPartition, OffsetSpec> latest =
                partitions.stream().collect(Collectors.toMap(p -> p, p -> OffsetSpec.latest()));
        long drainedSince = -1;
        while (true) {
            if (pc.isClosedOrFailed()) {
                System.err.println("Parallel Consumer stopped: " + pc.getFailureCause());
                return false;
            }
            Map<TopicPartition, Long> ends = new HashMap<>();
            admin.listOffsets(latest).all().get().forEach((p, info) -> ends.put(p, info.offset()));
            Map<TopicPartition, OffsetAndMetadata> committed =
                    admin.listConsumerGroupOffsets(group).partitionsToOffsetAndMetadata().get();
            boolean drained = pc.workRemaining() == 0 && ends.entrySet().stream().allMatch(e -> {
                OffsetAndMetadata c = committed.get(e.getKey());
                return e.getValue() == 0 || (c != null && c.offset() >= e.getValue());
            });
            long now = System.nanoTime();
            if (!drained) {
                drainedSince = -1;
            } else if (drainedSince < 0) {
                drainedSince = now;
            } else if ((now - drainedSince) / 1e9 >= idleS) {
                return true;
            }
            Thread.sleep(500);
        }
    }

    private static String header(ConsumerRecord<byte[], byte[]> record, String name) {
        Header h = record.headers().lastHeader(name);
        return h == null ? null : new String(h.value(), StandardCharsets.UTF_8);
    }

    private static Map<String, String> parse(String[] argv) {
        Map<String, String> out = new HashMap<>();
        for (int i = 0; i < argv.length; i += 2) {
            if (!argv[i].startsWith("--") || i + 1 >= argv.length) {
                throw new IllegalArgumentException("expected --name value pairs, got " + String.join(" ", argv));
            }
            out.put(argv[i].substring(2), argv[i + 1]);
        }
        return out;
    }

    private static String required(Map<String, String> args, String name) {
        String value = args.get(name);
        if (value == null) {
            throw new IllegalArgumentException("--" + name + " is required");
        }
        return value;
    }
}
