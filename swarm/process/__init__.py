"""Process plumbing every role shares: the event loop, the launch clock, leaving with the launcher,
the allocator's settings, how tensors are shared between processes."""
