//! The worker card: what a worker tells the cluster about itself, and where it is kept.
//!
//! A card is JSON at `/duet/<cluster>/workers/<role>/<worker-id>`, attached to the worker's
//! lease, so it disappears when the worker stops keeping the lease alive.

use serde::{Deserialize, Serialize};

use crate::error::ClusterError;

/// Which pool a worker serves in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Prefill,
    Decode,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

/// Where a worker is in its life: routable only when `Ready`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CardState {
    /// Registered, not yet serving.
    Joining,
    /// Serving; the router may send it work.
    Ready,
    /// Finishing what it holds before it exits; the router sends it nothing new.
    Draining,
}

/// A worker's card.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WorkerCard {
    pub worker_id: String,
    pub role: Role,
    /// The gRPC address others dial (the worker's `--advertise`).
    pub grpc_address: String,
    /// Where KV is pushed to this worker (decode workers; the gRPC address today).
    pub kv_address: String,
    /// The host the worker runs on (same-node transports need it).
    pub node: String,
    /// The device the engine runs on, as `--device` names it.
    pub device: String,
    pub model_fingerprint: String,
    /// Tokens per KV block.
    pub block_size: u32,
    /// KV blocks the worker holds.
    pub kv_capacity_blocks: u32,
    /// Changes with every registration (a new process, or a new lease after one was lost), so
    /// anything remembered about an earlier one is known to be stale.
    pub incarnation: u64,
    pub state: CardState,
}

impl WorkerCard {
    /// The card's key in `cluster`.
    pub fn key(&self, cluster: &str) -> String {
        format!(
            "{}{}/{}",
            workers_prefix(cluster),
            self.role.as_str(),
            self.worker_id
        )
    }

    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a worker card always serializes")
    }

    /// Parses the card stored at `key`; it must be the card of that key (role and id).
    pub fn parse(cluster: &str, key: &str, value: &[u8]) -> Result<Self, ClusterError> {
        let bad = |why: String| ClusterError::BadCard {
            key: key.to_string(),
            why,
        };
        let card: WorkerCard = serde_json::from_slice(value).map_err(|e| bad(e.to_string()))?;
        if card.key(cluster) != key {
            return Err(bad(format!(
                "the card is for {} worker {:?}, not for this key",
                card.role.as_str(),
                card.worker_id
            )));
        }
        if card.grpc_address.is_empty() {
            return Err(bad("no gRPC address".into()));
        }
        Ok(card)
    }
}

/// The prefix under which every worker card of `cluster` is kept (with a trailing `/`).
pub fn workers_prefix(cluster: &str) -> String {
    format!("/duet/{cluster}/workers/")
}

/// Checks that `name` can be a path segment of a key: 1 to 63 characters of ASCII letters,
/// digits, `-`, `_` and `.`, and not `.` or `..`.
pub fn validate_name(what: &str, name: &str) -> Result<(), ClusterError> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name != "."
        && name != ".."
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(ClusterError::BadName {
            what: what.to_string(),
            name: name.to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn card(id: &str) -> WorkerCard {
        WorkerCard {
            worker_id: id.into(),
            role: Role::Decode,
            grpc_address: "127.0.0.1:7000".into(),
            kv_address: "127.0.0.1:7000".into(),
            node: "host".into(),
            device: "cpu".into(),
            model_fingerprint: "fp".into(),
            block_size: 16,
            kv_capacity_blocks: 100,
            incarnation: 7,
            state: CardState::Ready,
        }
    }

    #[test]
    fn card_round_trips_at_its_key() {
        let c = card("d-1");
        let key = c.key("prod");
        assert_eq!(key, "/duet/prod/workers/decode/d-1");
        assert_eq!(WorkerCard::parse("prod", &key, &c.to_json()).unwrap(), c);
        let json = String::from_utf8(c.to_json()).unwrap();
        assert!(json.contains(r#""state":"ready""#), "{json}");
        assert!(json.contains(r#""role":"decode""#), "{json}");
    }

    #[test]
    fn bad_cards_name_their_key() {
        let key = "/duet/prod/workers/decode/d-1";
        let e = WorkerCard::parse("prod", key, b"{not json").unwrap_err();
        assert!(e.to_string().contains(key), "{e}");
        // A valid card under another worker's key.
        let e = WorkerCard::parse("prod", key, &card("d-2").to_json()).unwrap_err();
        assert!(e.to_string().contains("d-2"), "{e}");
    }

    #[test]
    fn names_are_checked() {
        for good in ["default", "prod-eu.1", "a_b", "X"] {
            validate_name("cluster", good).unwrap();
        }
        for bad in ["", "a/b", "..", ".", "spa ce", "ü", &"x".repeat(64)] {
            let e = validate_name("cluster", bad).unwrap_err();
            assert!(e.to_string().contains("cluster"), "{e}");
        }
    }
}
