//! etcd as a secured door (separate processes, a real etcd):
//! - served over TLS with `--client-cert-auth`: duet's services given `--etcd-ca`,
//!   `--etcd-cert` and `--etcd-key` register and route, while a client without a certificate
//!   cannot read or write the worker cards;
//! - with etcd's own authentication on: a service given `--etcd-user` and
//!   `--etcd-password-file` registers, a client without the user cannot read the cards;
//! - with a cluster token: a card written into the registry by an outsider (unsigned, or
//!   signed with another token) is never a member, so the router sends it nothing.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use duet_cluster::membership::follow;
use duet_cluster::{ClusterArgs, EtcdAuthArgs, Registration};
use duet_decode_worker::DecodeConfig;
use duet_router::RouterConfig;
use duet_tests::certs::Authority;
use duet_tests::etcd::Etcd;
use duet_tests::*;
use duet_worker::WorkerArgs;

fn tiny() -> duet_model::model_path::ModelArgs {
    duet_model::model_path::ModelArgs {
        model: Some(tiny_model()),
        ..Default::default()
    }
}

/// A decode worker and a router in `cluster`, as separate processes.
fn decode_and_router(cluster: &ClusterArgs) -> (Process, Process, SocketAddr) {
    let decode = DecodeConfig {
        listen: free_addr(),
        worker: WorkerArgs {
            cluster: cluster.clone(),
            model: tiny(),
            engine: engine_options(),
            ..Default::default()
        },
        ..Default::default()
    };
    let router = RouterConfig {
        listen: free_addr(),
        cluster: cluster.clone(),
        model: tiny(),
        ..Default::default()
    };
    let addr = router.listen;
    (
        Process::start("duet-decode", decode.to_args()),
        Process::start("duet-router", router.to_args()),
        addr,
    )
}

/// Waits (up to 60 s) until the router serves a request through a decode worker it learnt
/// from the registry.
fn serves(router: SocketAddr) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let served = rt.block_on(async {
            tokio::net::TcpStream::connect(router).await.ok()?;
            generate(router, greedy_request(&[1, 17, 250, 3], 2))
                .await
                .ok()
        });
        if let Some((ids, _, _)) = served {
            assert_eq!(ids.len(), 2);
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the router never served through etcd"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn with_client_certificates_duet_registers_and_routes_and_a_client_without_one_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Authority::new(dir.path(), "etcd");
    let etcd = Etcd::start_with_tls(ca.issue(dir.path(), "etcd-server"));
    let duet = ca.issue(dir.path(), "duet");
    let cluster = ClusterArgs {
        etcd: vec![etcd.url()],
        cluster: "tls".into(),
        etcd_auth: EtcdAuthArgs {
            etcd_ca: duet.tls_ca.clone(),
            etcd_cert: duet.tls_cert.clone(),
            etcd_key: duet.tls_key.clone(),
            ..Default::default()
        },
        ..Default::default()
    };
    let (_decode, _router, router) = decode_and_router(&cluster);
    serves(router);
    let cards = etcd
        .ctl(&["get", "--prefix", "/duet/tls/workers/"])
        .unwrap();
    assert!(cards.contains("/duet/tls/workers/decode/"), "{cards}");
    // Trusting the CA but with no client certificate, or with no TLS flags at all: neither
    // reads nor writes a card.
    let cacert = format!("--cacert={}", ca.ca.display());
    for (who, flags) in [
        ("no certificate", vec![cacert.as_str()]),
        ("no TLS flags", vec![]),
    ] {
        let read = etcd.ctl_as(&flags, &["get", "--prefix", "/duet/"]);
        assert!(read.is_err(), "{who} read the cards: {read:?}");
        let write = etcd.ctl_as(&flags, &["put", "/duet/tls/workers/decode/rogue", "{}"]);
        assert!(write.is_err(), "{who} wrote a card: {write:?}");
    }
    let after = etcd
        .ctl(&["get", "--prefix", "--keys-only", "/duet/tls/workers/"])
        .unwrap();
    assert!(!after.contains("rogue"), "{after}");
}

#[test]
fn with_an_etcd_user_duet_registers_and_a_client_without_it_cannot_read() {
    let etcd = Etcd::start();
    let dir = tempfile::tempdir().unwrap();
    etcd.ctl(&["user", "add", "root:root-secret"]).unwrap();
    etcd.ctl(&["auth", "enable"]).unwrap();
    let password = dir.path().join("password");
    std::fs::write(&password, "root-secret\n").unwrap();
    let cluster = ClusterArgs {
        etcd: vec![etcd.url()],
        cluster: "users".into(),
        etcd_auth: EtcdAuthArgs {
            etcd_user: Some("root".into()),
            etcd_password_file: Some(password),
            ..Default::default()
        },
        ..Default::default()
    };
    let (_decode, _router, router) = decode_and_router(&cluster);
    serves(router);
    let as_root = etcd
        .ctl_as(
            &["--user", "root:root-secret"],
            &["get", "--prefix", "--keys-only", "/duet/users/"],
        )
        .unwrap();
    assert!(as_root.contains("/duet/users/workers/decode/"), "{as_root}");
    let anonymous = etcd.ctl_as(&[], &["get", "--prefix", "/duet/"]);
    assert!(anonymous.is_err(), "read without a user: {anonymous:?}");
    // A wrong password is a clear error at connect.
    let wrong = dir.path().join("wrong");
    std::fs::write(&wrong, "guess").unwrap();
    let bad = ClusterArgs {
        etcd_auth: EtcdAuthArgs {
            etcd_password_file: Some(wrong),
            ..cluster.etcd_auth.clone()
        },
        ..cluster.clone()
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    let Err(e) = rt.block_on(bad.connect()) else {
        panic!("a wrong password is refused");
    };
    assert!(e.to_string().contains("etcd at"), "{e}");
}

/// What a registry user with no token can do: write a card of its own choosing.
async fn put_raw(cluster: &ClusterArgs, key: &str, value: &[u8]) {
    let registry = cluster.connect().await.unwrap();
    let lease = registry.grant(Duration::from_secs(60)).await.unwrap();
    assert!(registry.put_if(key, None, value, lease).await.unwrap());
}

#[test]
fn with_a_cluster_token_a_forged_card_is_never_a_member() {
    let etcd = Etcd::start();
    let token = b"the-real-cluster-token-0123456789".as_slice();
    let cluster = ClusterArgs {
        etcd: vec![etcd.url()],
        cluster: "signed".into(),
        ..Default::default()
    }
    .signed_with(Some(token));
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let _real = Registration::start(
            cluster.clone(),
            Duration::from_secs(10),
            decode_card("real", 7001),
        )
        .unwrap();
        let unsigned = decode_card("rogue", 7002);
        put_raw(&cluster, &unsigned.key("signed"), &unsigned.to_stored(None)).await;
        let other = decode_card("other-token", 7003);
        let other_key = duet_cluster::CardKey::new(b"another-token-0123456789abcdef");
        put_raw(
            &cluster,
            &other.key("signed"),
            &other.to_stored(Some(&other_key)),
        )
        .await;
        let (rx, follower) = follow(cluster.clone(), Duration::from_secs(600));
        let deadline = Instant::now() + Duration::from_secs(20);
        let members = loop {
            let ids: Vec<String> = rx
                .borrow()
                .cards
                .values()
                .map(|c| c.worker_id.clone())
                .collect();
            if !ids.is_empty() || Instant::now() > deadline {
                break ids;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        follower.abort();
        assert_eq!(
            members,
            ["real"],
            "only the card signed with the cluster's token"
        );
        // A follower without the token (an older router) would have taken them all: the
        // cards are there.
        let (rx, follower) = follow(
            ClusterArgs {
                card_key: None,
                ..cluster.clone()
            },
            Duration::from_secs(600),
        );
        let deadline = Instant::now() + Duration::from_secs(20);
        while rx.borrow().cards.len() < 3 {
            assert!(Instant::now() < deadline, "the raw cards are in etcd");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        follower.abort();
    });
}
