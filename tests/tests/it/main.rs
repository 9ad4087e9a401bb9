//! The cross-service integration tests, one binary: every module is a former test file, linked
//! once. Tests here run concurrently (the default test threads): each cluster binds its own
//! loopback ports (`free_addr`), keeps its state in its own temporary directories, and in-process
//! clusters stay apart in the shared embedded registry by name. Tests that time a cluster
//! against deadlines live in the `timed` binary instead, which runs them one at a time.

mod api_keys;
mod auth;
mod chaos;
mod disaggregated;
mod etcd_cluster;
mod etcd_security;
mod failures;
mod gie_front;
mod kv_routing;
mod kv_tiers;
mod membership;
mod openai;
mod otlp;
mod planner;
mod prometheus;
mod refused_prefill;
mod role_switch;
mod structured_failover;
mod tls;
