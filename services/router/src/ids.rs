//! Random values the router hands out: request ids, default seeds, the random routing policy's
//! draws. One generator for all of them, the operating system's (`getrandom`), so that no two
//! routers or restarts hand out the same stream.

/// A random 64-bit value.
pub fn random_u64() -> u64 {
    let mut bytes = [0u8; 8];
    // Linux's getrandom(2) fails only on a kernel without it (before 3.17) and no /dev/urandom.
    getrandom::fill(&mut bytes).expect("the operating system's random source failed");
    u64::from_le_bytes(bytes)
}

/// The id of a request whose client named none.
pub fn request_id() -> String {
    format!("req-{:016x}", random_u64())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_and_ids_differ() {
        assert_ne!(random_u64(), random_u64());
        let (a, b) = (request_id(), request_id());
        assert_ne!(a, b);
        assert!(a.starts_with("req-") && a.len() == 20, "{a}");
    }
}
