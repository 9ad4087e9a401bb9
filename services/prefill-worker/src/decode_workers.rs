//! The decode workers a prefill worker may push KV to. A `Prefill` request names where its KV
//! goes; the worker pushes only to a decode worker it knows, so a caller cannot have it send KV
//! (and the cluster token with it) to an address of the caller's choosing.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use duet_cluster::{Membership, Role};
use tokio::sync::watch;

/// How often the prefill worker lists its cluster's cards again besides watching them (the
/// anti-entropy pass of [`duet_cluster::membership`]).
pub const MEMBERSHIP_RESYNC: Duration = Duration::from_secs(30);

/// Where KV may go: the decode workers named by `--decode`, and those whose card is in the
/// cluster's membership now (their `kv_address`).
#[derive(Clone, Debug)]
pub struct KnownDecodeWorkers {
    listed: Arc<HashSet<String>>,
    membership: watch::Receiver<Arc<Membership>>,
}

impl KnownDecodeWorkers {
    pub fn new<S: AsRef<str>>(
        listed: impl IntoIterator<Item = S>,
        membership: watch::Receiver<Arc<Membership>>,
    ) -> Self {
        let listed = listed
            .into_iter()
            .map(|a| a.as_ref().trim().to_string())
            .filter(|a| !a.is_empty())
            .collect();
        Self {
            listed: Arc::new(listed),
            membership,
        }
    }

    /// Whether `transfer_address` (a `KvDestination.transfer_address`) is a decode worker's.
    pub fn knows(&self, transfer_address: &str) -> bool {
        self.listed.contains(transfer_address)
            || self
                .membership
                .borrow()
                .cards
                .values()
                .any(|c| c.role == Role::Decode && c.kv_address == transfer_address)
    }
}

#[cfg(test)]
mod tests {
    use duet_cluster::{CardState, WorkerCard};

    use super::*;

    fn card(role: Role, kv_address: &str) -> WorkerCard {
        WorkerCard {
            worker_id: kv_address.into(),
            role,
            grpc_address: kv_address.into(),
            kv_address: kv_address.into(),
            node: "n".into(),
            device: "cpu".into(),
            model_fingerprint: "f".into(),
            block_size: 16,
            kv_capacity_blocks: 8,
            incarnation: 1,
            state: CardState::Ready,
        }
    }

    #[test]
    fn listed_addresses_and_decode_cards_are_known_and_nothing_else() {
        let (tx, rx) = watch::channel(Arc::new(Membership::default()));
        let known = KnownDecodeWorkers::new([" 127.0.0.1:7001", ""], rx);
        assert!(known.knows("127.0.0.1:7001"));
        assert!(!known.knows("10.0.0.9:7001"));
        assert!(!known.knows(""));
        let mut m = Membership::default();
        for c in [
            card(Role::Decode, "10.0.0.9:7001"),
            card(Role::Prefill, "10.0.0.8:7002"),
        ] {
            m.cards.insert(c.worker_id.clone(), c);
        }
        tx.send_replace(Arc::new(m));
        assert!(known.knows("10.0.0.9:7001"), "a decode worker that joined");
        assert!(
            !known.knows("10.0.0.8:7002"),
            "a prefill worker is no KV destination"
        );
        tx.send_replace(Arc::new(Membership::default()));
        assert!(!known.knows("10.0.0.9:7001"), "a decode worker that left");
    }
}
