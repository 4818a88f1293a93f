# tests/compat is a harness, not a test suite: `make test` collects nothing here
# (the alias package in alias/ must never be imported into the normal test session).
collect_ignore_glob = ["*"]
