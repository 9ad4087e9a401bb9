//! The `duet` command's library side: the loopback cluster launcher shared by `duet up` and the
//! integration tests.

pub mod cluster;
