"""Generated stubs of Triton's vendored KServe v2 protos (``third_party/triton``; ``make proto``)."""
