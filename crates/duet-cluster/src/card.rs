//! The worker card: what a worker tells the cluster about itself, and where it is kept.
//!
//! A card is JSON at `/duet/<cluster>/workers/<role>/<worker-id>`, attached to the worker's
//! lease, so it disappears when the worker stops keeping the lease alive.
//!
//! With a cluster token, every card is signed with it ([`CardKey`]: HMAC-SHA256 of the card's
//! JSON, stored beside it as `signature`) and a card without a valid signature is not a member:
//! whoever can write to the registry but holds no token cannot slip a worker of its own into
//! the cluster and have the router send it prompts (and the token).

use std::sync::Arc;

use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

use crate::error::ClusterError;

/// Which pool a worker serves in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
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

/// The key cards are signed and checked with: the cluster token's bytes.
#[derive(Clone, PartialEq, Eq)]
pub struct CardKey(Arc<[u8]>);

impl std::fmt::Debug for CardKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CardKey(..)")
    }
}

impl CardKey {
    pub fn new(secret: &[u8]) -> Self {
        Self(secret.into())
    }

    fn mac(&self, card: &WorkerCard) -> Hmac<Sha256> {
        let mut mac =
            Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes a key of any length");
        mac.update(&card.to_json());
        mac
    }

    /// `card`'s signature, in hex.
    pub fn sign(&self, card: &WorkerCard) -> String {
        let tag = self.mac(card).finalize().into_bytes();
        tag.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Whether `signature` (hex) is `card`'s (compared in constant time).
    pub fn verify(&self, card: &WorkerCard, signature: &str) -> bool {
        let Some(tag) = from_hex(signature) else {
            return false;
        };
        self.mac(card).verify_slice(&tag).is_ok()
    }
}

fn from_hex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// A card as the registry holds it: with its signature when the cluster has a token.
#[derive(Serialize, Deserialize)]
struct StoredCard {
    #[serde(flatten)]
    card: WorkerCard,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    signature: Option<String>,
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

    /// The card as the registry stores it: signed with `key` when there is one.
    pub fn to_stored(&self, key: Option<&CardKey>) -> Vec<u8> {
        let stored = StoredCard {
            card: self.clone(),
            signature: key.map(|k| k.sign(self)),
        };
        serde_json::to_vec(&stored).expect("a worker card always serializes")
    }

    /// Parses the card stored at `key`; it must be the card of that key (role and id), and,
    /// with a `card_key`, carry that key's signature.
    pub fn parse(
        cluster: &str,
        key: &str,
        value: &[u8],
        card_key: Option<&CardKey>,
    ) -> Result<Self, ClusterError> {
        let bad = |why: String| ClusterError::BadCard {
            key: key.to_string(),
            why,
        };
        let stored: StoredCard = serde_json::from_slice(value).map_err(|e| bad(e.to_string()))?;
        let card = stored.card;
        if let Some(card_key) = card_key {
            match &stored.signature {
                None => {
                    return Err(bad(
                        "it is not signed, and this cluster has a token: cards are signed by \
                         workers started with the cluster's token"
                            .into(),
                    ));
                }
                Some(s) if !card_key.verify(&card, s) => {
                    return Err(bad(
                        "its signature does not match: it was written by a worker with another \
                         cluster token, or forged"
                            .into(),
                    ));
                }
                Some(_) => {}
            }
        }
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
        assert_eq!(
            WorkerCard::parse("prod", &key, &c.to_stored(None), None).unwrap(),
            c
        );
        let json = String::from_utf8(c.to_json()).unwrap();
        assert!(json.contains(r#""state":"ready""#), "{json}");
        assert!(json.contains(r#""role":"decode""#), "{json}");
    }

    #[test]
    fn bad_cards_name_their_key() {
        let key = "/duet/prod/workers/decode/d-1";
        let e = WorkerCard::parse("prod", key, b"{not json", None).unwrap_err();
        assert!(e.to_string().contains(key), "{e}");
        // A valid card under another worker's key.
        let e = WorkerCard::parse("prod", key, &card("d-2").to_stored(None), None).unwrap_err();
        assert!(e.to_string().contains("d-2"), "{e}");
    }

    /// With a cluster token, only cards signed with it are members: an unsigned card, one
    /// signed with another token, and a signed card changed afterwards (its address pointed
    /// elsewhere) are refused, each with a message saying which.
    #[test]
    fn cards_are_signed_and_checked_with_the_cluster_token() {
        let key = CardKey::new(b"the-cluster-token-0123456789");
        let c = card("d-1");
        let at = c.key("prod");
        let signed = c.to_stored(Some(&key));
        assert_eq!(
            WorkerCard::parse("prod", &at, &signed, Some(&key)).unwrap(),
            c
        );
        // A cluster without a token reads signed cards too.
        assert_eq!(WorkerCard::parse("prod", &at, &signed, None).unwrap(), c);
        let unsigned = WorkerCard::parse("prod", &at, &c.to_stored(None), Some(&key)).unwrap_err();
        assert!(unsigned.to_string().contains("not signed"), "{unsigned}");
        let other = CardKey::new(b"another-token-0123456789abcdef");
        let e = WorkerCard::parse("prod", &at, &c.to_stored(Some(&other)), Some(&key)).unwrap_err();
        assert!(e.to_string().contains("does not match"), "{e}");
        let tampered = String::from_utf8(signed)
            .unwrap()
            .replace("127.0.0.1:7000", "10.6.6.6:7000");
        let e = WorkerCard::parse("prod", &at, tampered.as_bytes(), Some(&key)).unwrap_err();
        assert!(e.to_string().contains("does not match"), "{e}");
        assert!(!key.verify(&c, "zz"));
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
