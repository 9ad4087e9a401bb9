//! Membership against a real etcd (no model): a revoked lease, a compacted watch, and etcd
//! stopped and started again.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use duet_cluster::membership::{CardRules, Membership, follow, follow_registry};
use duet_cluster::registry::{Changes, LeaseId, Listing, Registry};
use duet_cluster::{ClusterArgs, ClusterError, EtcdRegistry, Registration};
use duet_tests::decode_card;
use duet_tests::etcd::Etcd;
use tokio::sync::{Notify, watch};

fn cluster(etcd: &Etcd, name: &str) -> ClusterArgs {
    ClusterArgs {
        etcd: vec![etcd.url()],
        cluster: name.into(),
        ..Default::default()
    }
}

/// Waits up to `secs` for `f` to give something.
async fn until<T>(secs: u64, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(t) = f() {
            return t;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn ids(m: &Membership) -> Vec<String> {
    m.cards.values().map(|c| c.worker_id.clone()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_revoked_with_etcdctl_is_replaced_by_a_new_incarnation() {
    let etcd = Etcd::start();
    let r = Registration::start(
        cluster(&etcd, "revoke"),
        Duration::from_secs(10),
        decode_card("d-1", 1),
    )
    .unwrap();
    let first = until(10, "registration", || r.registered()).await;
    let key = r.key().to_string();
    let stored = etcd.ctl(&["get", &key, "--print-value-only"]).unwrap();
    assert!(
        stored.contains(&format!(r#""incarnation":{}"#, first.incarnation)),
        "{stored}"
    );

    etcd.ctl(&["lease", "revoke", &format!("{:x}", first.lease)])
        .unwrap();
    let second = until(10, "a new registration", || {
        r.registered().filter(|s| s.lease != first.lease)
    })
    .await;
    assert!(second.incarnation > first.incarnation);
    let stored = etcd.ctl(&["get", &key, "--print-value-only"]).unwrap();
    assert!(
        stored.contains(&format!(r#""incarnation":{}"#, second.incarnation)),
        "{stored}"
    );

    r.deregister().await;
    assert_eq!(
        etcd.ctl(&["get", &key]).unwrap().trim(),
        "",
        "deregistering removes the card"
    );
}

/// etcd, but the first watch waits until the test lets it go.
#[derive(Debug)]
struct HeldWatch {
    etcd: EtcdRegistry,
    listed: Notify,
    release: Notify,
    first: Mutex<bool>,
}

#[async_trait::async_trait]
impl Registry for HeldWatch {
    async fn grant(&self, ttl: Duration) -> Result<LeaseId, ClusterError> {
        self.etcd.grant(ttl).await
    }
    async fn keep_alive(&self, lease: LeaseId) -> Result<bool, ClusterError> {
        self.etcd.keep_alive(lease).await
    }
    async fn revoke(&self, lease: LeaseId) -> Result<(), ClusterError> {
        self.etcd.revoke(lease).await
    }
    async fn put_if(
        &self,
        key: &str,
        expected: Option<&[u8]>,
        value: &[u8],
        lease: LeaseId,
    ) -> Result<bool, ClusterError> {
        self.etcd.put_if(key, expected, value, lease).await
    }
    async fn list(&self, prefix: &str) -> Result<Listing, ClusterError> {
        self.etcd.list(prefix).await
    }
    async fn watch(&self, prefix: &str, from: i64) -> Result<Changes, ClusterError> {
        let first = std::mem::replace(&mut *self.first.lock().unwrap(), false);
        if first {
            self.listed.notify_one();
            self.release.notified().await;
        }
        self.etcd.watch(prefix, from).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_compacted_past_its_revision_lists_again_and_stays_right() {
    let etcd = Etcd::start();
    let c = cluster(&etcd, "compact");
    let a = Registration::start(c.clone(), Duration::from_secs(10), decode_card("a", 1)).unwrap();
    until(10, "a", || a.registered()).await;
    let registry = Arc::new(HeldWatch {
        etcd: EtcdRegistry::connect(&c.etcd, Default::default())
            .await
            .unwrap(),
        listed: Notify::new(),
        release: Notify::new(),
        first: Mutex::new(true),
    });
    let (tx, rx) = watch::channel(Arc::new(Membership::default()));
    let rules = CardRules {
        cluster: "compact".into(),
        key: None,
    };
    let follower = tokio::spawn(follow_registry(
        registry.clone(),
        rules,
        Duration::from_secs(600),
        tx,
    ));
    // Listed (a), not yet watching: b joins, a leaves, and etcd compacts past the listing.
    registry.listed.notified().await;
    assert_eq!(ids(&rx.borrow()), ["a"]);
    let listed_at = rx.borrow().revision;
    let b = Registration::start(c.clone(), Duration::from_secs(10), decode_card("b", 2)).unwrap();
    until(10, "b", || b.registered()).await;
    a.deregister().await;
    let status = etcd.ctl(&["endpoint", "status", "-w", "json"]).unwrap();
    let now = status
        .split(r#""revision":"#)
        .nth(1)
        .and_then(|s| s.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|s| s.parse::<i64>().ok())
        .unwrap_or_else(|| panic!("no revision in {status}"));
    assert!(now > listed_at + 1);
    etcd.ctl(&["compaction", &now.to_string()]).unwrap();
    registry.release.notify_one();

    let m = until(10, "a re-list after the compacted watch", || {
        let m = rx.borrow().clone();
        (m.lists >= 2).then_some(m)
    })
    .await;
    assert_eq!(ids(&m), ["b"], "the re-list sees b joined and a gone");
    // And the new watch works: c joins.
    let c3 = Registration::start(c, Duration::from_secs(10), decode_card("c", 3)).unwrap();
    until(10, "c seen", || {
        (ids(&rx.borrow()) == ["b", "c"]).then_some(())
    })
    .await;
    drop((b, c3));
    follower.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_down_keeps_the_last_membership_and_it_converges_when_etcd_returns() {
    let mut etcd = Etcd::start();
    let c = cluster(&etcd, "outage");
    let a = Registration::start(c.clone(), Duration::from_secs(10), decode_card("a", 1)).unwrap();
    let b = Registration::start(c.clone(), Duration::from_secs(10), decode_card("b", 2)).unwrap();
    until(10, "a and b", || a.registered().and(b.registered())).await;
    let (rx, follower) = follow(c.clone(), Duration::from_secs(600));
    until(10, "both seen", || {
        (ids(&rx.borrow()) == ["a", "b"]).then_some(())
    })
    .await;
    let lists_before = rx.borrow().lists;

    etcd.stop();
    tokio::time::sleep(Duration::from_secs(15)).await;
    assert_eq!(
        ids(&rx.borrow()),
        ["a", "b"],
        "etcd down: the last-known membership stays"
    );
    etcd.start_again();

    // b leaves and d joins once etcd is back: the follower converges on them.
    b.deregister().await;
    let d = Registration::start(c, Duration::from_secs(10), decode_card("d", 4)).unwrap();
    until(20, "convergence", || {
        (ids(&rx.borrow()) == ["a", "d"]).then_some(())
    })
    .await;
    assert!(
        rx.borrow().lists > lists_before,
        "the broken watch led to a re-list"
    );
    until(20, "a registered", || a.registered()).await;
    drop((a, d));
    follower.abort();
}
