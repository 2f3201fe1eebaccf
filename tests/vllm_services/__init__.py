"""The vLLM service tests that share one cluster (conftest.py). A package, so that its
package-scoped fixture stops when the package's last test is done (in a plain folder it would
live until the session ends)."""
