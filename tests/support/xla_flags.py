"""The XLA flags the test run compiles with on a CPU-only install (tests/conftest.py sets them;
scripts/test_xla_flags.py checks that they give the served results bit for bit)."""

TEST_XLA_FLAGS = ("--xla_llvm_disable_expensive_passes=true", "--xla_backend_optimization_level=1")
