"""The secured test broker's ports: free, in a row, and never in the kernel's ephemeral range,
where any outgoing connection may take one between the check and the broker's bind."""

from __future__ import annotations

import socket

from varadhi.testing import secure_kafka


def test_ports_are_drawn_below_the_ephemeral_range():
    low = secure_kafka.ephemeral_low()
    for _ in range(50):
        port = secure_kafka.free_port_pair()
        assert port >= 20000 and port + 3 < low


def test_the_ports_drawn_are_free_in_a_row():
    port = secure_kafka.free_port_pair()
    for p in range(port, port + 4):
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_the_ephemeral_range_is_read_from_the_kernel_setting(tmp_path):
    setting = tmp_path / "ip_local_port_range"
    setting.write_text("40000\t60999\n")
    assert secure_kafka.ephemeral_low(setting) == 40000
    assert secure_kafka.ephemeral_low(tmp_path / "absent") == 32768
