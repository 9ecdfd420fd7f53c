"""What the tests share: the tiny-model kits, servers (in process, in a thread, in a
subprocess), HTTP helpers, scheduler drivers. No test module imports another."""
