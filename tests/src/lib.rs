//! Shared harness for the cross-service integration tests.
