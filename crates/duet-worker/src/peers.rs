//! The workers of the other role a worker deals with, so that no caller can name an address of
//! its own choosing: a prefill worker pushes KV (and the cluster token with it) only to a decode
//! worker it knows, and a decode worker asks (and takes KV from) only the prefill workers it
//! knows. A worker knows the peers named by its flags (`--decode` / `--prefill`) and those whose
//! card is in its cluster's membership now.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use duet_cluster::{Membership, Role};
use tokio::sync::watch;

/// How often a worker lists its cluster's cards again besides watching them (the anti-entropy
/// pass of [`duet_cluster::membership`]).
pub const MEMBERSHIP_RESYNC: Duration = Duration::from_secs(30);

/// The peers of one role a worker knows.
#[derive(Clone, Debug)]
pub struct KnownPeers {
    role: Role,
    listed: Arc<HashSet<String>>,
    membership: watch::Receiver<Arc<Membership>>,
}

impl KnownPeers {
    /// Workers of `role`: those at the `listed` addresses, and those whose cards `membership`
    /// holds.
    pub fn new<S: AsRef<str>>(
        role: Role,
        listed: impl IntoIterator<Item = S>,
        membership: watch::Receiver<Arc<Membership>>,
    ) -> Self {
        let listed = listed
            .into_iter()
            .map(|a| a.as_ref().trim().to_string())
            .filter(|a| !a.is_empty())
            .collect();
        Self {
            role,
            listed: Arc::new(listed),
            membership,
        }
    }

    /// Whether `address` (a gRPC or KV transfer address) is a known peer's; `worker_id`, when
    /// given, must be the id on that peer's card (a listed address has no card to check).
    pub fn knows(&self, address: &str, worker_id: Option<&str>) -> bool {
        self.listed.contains(address)
            || self.membership.borrow().cards.values().any(|c| {
                c.role == self.role
                    && (c.grpc_address == address || c.kv_address == address)
                    && worker_id.is_none_or(|id| id == c.worker_id)
            })
    }

    /// The addresses `worker_id` may be at: its card's gRPC and KV addresses, or, for a worker
    /// without a card, the listed addresses (a flag names no worker id).
    pub fn addresses_of(&self, worker_id: &str) -> Vec<String> {
        let membership = self.membership.borrow();
        let carded: Vec<String> = membership
            .cards
            .values()
            .filter(|c| c.role == self.role && c.worker_id == worker_id)
            .flat_map(|c| [c.grpc_address.clone(), c.kv_address.clone()])
            .collect();
        if carded.is_empty() {
            self.listed.iter().cloned().collect()
        } else {
            carded
        }
    }

    /// The gRPC addresses of every peer known now: the listed ones and those of the cards.
    pub fn addresses(&self) -> Vec<String> {
        let membership = self.membership.borrow();
        let carded = membership
            .cards
            .values()
            .filter(|c| c.role == self.role)
            .map(|c| c.grpc_address.clone());
        let mut all: Vec<String> = self.listed.iter().cloned().chain(carded).collect();
        all.sort();
        all.dedup();
        all
    }

    /// Whether any peer is known now.
    pub fn any(&self) -> bool {
        !self.listed.is_empty()
            || self
                .membership
                .borrow()
                .cards
                .values()
                .any(|c| c.role == self.role)
    }

    /// Resolves after the membership changes (never, once its follower is gone).
    pub async fn changed(&mut self) {
        if self.membership.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use duet_cluster::{CardState, WorkerCard};

    use super::*;

    fn card(role: Role, id: &str, address: &str) -> WorkerCard {
        WorkerCard {
            worker_id: id.into(),
            role,
            grpc_address: address.into(),
            kv_address: address.into(),
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
    fn listed_addresses_and_cards_of_the_role_are_known_and_nothing_else() {
        let (tx, rx) = watch::channel(Arc::new(Membership::default()));
        let known = KnownPeers::new(Role::Decode, [" 127.0.0.1:7001", ""], rx);
        assert!(known.any());
        assert!(known.knows("127.0.0.1:7001", None));
        assert!(!known.knows("10.0.0.9:7001", None));
        assert!(!known.knows("", None));
        let mut m = Membership::default();
        for c in [
            card(Role::Decode, "d-9", "10.0.0.9:7001"),
            card(Role::Prefill, "p-8", "10.0.0.8:7002"),
        ] {
            m.cards.insert(c.worker_id.clone(), c);
        }
        tx.send_replace(Arc::new(m));
        assert_eq!(known.addresses(), ["10.0.0.9:7001", "127.0.0.1:7001"]);
        assert!(
            known.knows("10.0.0.9:7001", None),
            "a decode worker that joined"
        );
        assert!(known.knows("10.0.0.9:7001", Some("d-9")));
        assert!(
            !known.knows("10.0.0.9:7001", Some("d-impostor")),
            "another worker id at a member's address"
        );
        assert!(
            !known.knows("10.0.0.8:7002", None),
            "a prefill worker is not a decode worker"
        );
        tx.send_replace(Arc::new(Membership::default()));
        assert!(
            !known.knows("10.0.0.9:7001", None),
            "a decode worker that left"
        );
    }

    #[test]
    fn with_no_flags_a_peer_is_known_once_its_card_is() {
        let (tx, rx) = watch::channel(Arc::new(Membership::default()));
        let known = KnownPeers::new(Role::Prefill, Vec::<String>::new(), rx);
        assert!(!known.any());
        let mut m = Membership::default();
        let c = card(Role::Prefill, "p-1", "10.0.0.1:7000");
        m.cards.insert(c.worker_id.clone(), c);
        tx.send_replace(Arc::new(m));
        assert!(known.any() && known.knows("10.0.0.1:7000", Some("p-1")));
    }
}
