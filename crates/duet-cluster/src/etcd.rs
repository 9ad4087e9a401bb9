//! The registry on a real etcd, through the `etcd-client` crate.

use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, PutOptions, Txn, TxnOp,
    WatchOptions,
};
use futures::StreamExt;

use crate::args::EtcdSecurity;
use crate::error::ClusterError;
use crate::registry::{Change, Changes, Entry, LeaseId, Listing, Registry};

/// Longest any single etcd call may take: an unreachable etcd must not hang a keep-alive or a
/// list.
const CALL_TIMEOUT: Duration = Duration::from_secs(3);

/// etcd at one or more endpoints.
#[derive(Clone)]
pub struct EtcdRegistry {
    client: Client,
    /// For error messages: the endpoints as given.
    endpoints: String,
}

impl std::fmt::Debug for EtcdRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdRegistry")
            .field("endpoints", &self.endpoints)
            .finish()
    }
}

impl EtcdRegistry {
    /// Connects to `endpoints` (`host:port` or URLs) with `security` (TLS, a user) and checks
    /// that etcd answers.
    pub async fn connect(
        endpoints: &[String],
        security: EtcdSecurity,
    ) -> Result<Self, ClusterError> {
        let named = endpoints.join(",");
        let fail = |message: String| ClusterError::Etcd {
            endpoints: named.clone(),
            message,
        };
        let mut options = ConnectOptions::new()
            .with_connect_timeout(CALL_TIMEOUT)
            .with_timeout(CALL_TIMEOUT)
            .with_keep_alive(Duration::from_secs(2), CALL_TIMEOUT)
            .with_keep_alive_while_idle(true);
        if let Some(tls) = security.tls {
            if let Some(plain) = endpoints.iter().find(|e| e.starts_with("http://")) {
                return Err(ClusterError::EtcdConfig(format!(
                    "--etcd-ca is set but {plain} is an http:// endpoint: give https:// or no scheme"
                )));
            }
            options = options.with_tls(tls);
        }
        if let Some((user, password)) = security.user {
            options = options.with_user(user, password);
        }
        let client = tokio::time::timeout(CALL_TIMEOUT, Client::connect(endpoints, Some(options)))
            .await
            .map_err(|_| fail("no answer (connect timed out)".into()))?
            .map_err(|e| fail(e.to_string()))?;
        let registry = Self {
            client,
            endpoints: named.clone(),
        };
        // Connecting is lazy: a read proves etcd is there.
        registry.list("/duet/").await?;
        Ok(registry)
    }

    fn error(&self, e: etcd_client::Error) -> ClusterError {
        ClusterError::Etcd {
            endpoints: self.endpoints.clone(),
            message: e.to_string(),
        }
    }

    /// Runs one call with the call timeout.
    async fn call<T>(
        &self,
        f: impl Future<Output = Result<T, etcd_client::Error>>,
    ) -> Result<T, ClusterError> {
        match tokio::time::timeout(CALL_TIMEOUT, f).await {
            Ok(r) => r.map_err(|e| self.error(e)),
            Err(_) => Err(ClusterError::Etcd {
                endpoints: self.endpoints.clone(),
                message: format!("no answer within {CALL_TIMEOUT:?}"),
            }),
        }
    }
}

fn entry(kv: &etcd_client::KeyValue) -> Entry {
    Entry {
        key: String::from_utf8_lossy(kv.key()).into_owned(),
        value: kv.value().to_vec(),
    }
}

#[async_trait::async_trait]
impl Registry for EtcdRegistry {
    async fn grant(&self, ttl: Duration) -> Result<LeaseId, ClusterError> {
        let mut c = self.client.clone();
        let ttl = ttl.as_secs().max(1) as i64;
        Ok(self.call(c.lease_grant(ttl, None)).await?.id())
    }

    async fn keep_alive(&self, lease: LeaseId) -> Result<bool, ClusterError> {
        let mut c = self.client.clone();
        // Opening the keep-alive stream sends one keep-alive and reads its answer: a refresh.
        match tokio::time::timeout(CALL_TIMEOUT, c.lease_keep_alive(lease)).await {
            Ok(Ok(_)) => Ok(true),
            // etcd answers a TTL of 0 for a lease it does not have; the client reports that so.
            Ok(Err(etcd_client::Error::LeaseKeepAliveError(m))) if m == "lease not found" => {
                Ok(false)
            }
            Ok(Err(e)) => Err(self.error(e)),
            Err(_) => Err(ClusterError::Etcd {
                endpoints: self.endpoints.clone(),
                message: format!("no answer within {CALL_TIMEOUT:?}"),
            }),
        }
    }

    async fn revoke(&self, lease: LeaseId) -> Result<(), ClusterError> {
        let mut c = self.client.clone();
        self.call(c.lease_revoke(lease)).await.map(|_| ())
    }

    async fn put_if(
        &self,
        key: &str,
        expected: Option<&[u8]>,
        value: &[u8],
        lease: LeaseId,
    ) -> Result<bool, ClusterError> {
        let mut c = self.client.clone();
        let condition = match expected {
            None => Compare::create_revision(key, CompareOp::Equal, 0),
            Some(v) => Compare::value(key, CompareOp::Equal, v),
        };
        let txn = Txn::new().when([condition]).and_then([TxnOp::put(
            key,
            value,
            Some(PutOptions::new().with_lease(lease)),
        )]);
        Ok(self.call(c.txn(txn)).await?.succeeded())
    }

    async fn list(&self, prefix: &str) -> Result<Listing, ClusterError> {
        let mut c = self.client.clone();
        let r = self
            .call(c.get(prefix, Some(GetOptions::new().with_prefix())))
            .await?;
        Ok(Listing {
            entries: r.kvs().iter().map(entry).collect(),
            revision: r.header().map_or(0, |h| h.revision()),
        })
    }

    async fn watch(&self, prefix: &str, from: i64) -> Result<Changes, ClusterError> {
        let mut c = self.client.clone();
        let options = WatchOptions::new().with_prefix().with_start_revision(from);
        let stream = self.call(c.watch(prefix, Some(options))).await?;
        let me = self.clone();
        // The whole WatchStream is kept: dropping its request half would end the watch.
        Ok(futures::stream::unfold(Some(stream), move |stream| {
            let me = me.clone();
            async move {
                let mut stream = stream?;
                loop {
                    let r = match stream.message().await {
                        Ok(Some(r)) => r,
                        Ok(None) => {
                            let e = ClusterError::Interrupted("etcd closed the watch".into());
                            return Some((Err(e), None));
                        }
                        Err(e) => return Some((Err(me.error(e)), None)),
                    };
                    if r.canceled() {
                        let e = if r.compact_revision() > 0 {
                            ClusterError::Compacted { revision: from }
                        } else {
                            ClusterError::Interrupted(format!(
                                "etcd cancelled the watch: {}",
                                r.cancel_reason()
                            ))
                        };
                        return Some((Err(e), None));
                    }
                    let changes: Vec<Change> = r
                        .events()
                        .iter()
                        .filter_map(|ev| {
                            let kv = ev.kv()?;
                            Some(match ev.event_type() {
                                EventType::Put => Change::Put(entry(kv)),
                                EventType::Delete => Change::Delete(entry(kv).key),
                            })
                        })
                        .collect();
                    // Created and progress notices carry no events.
                    if !changes.is_empty() {
                        return Some((Ok(changes), Some(stream)));
                    }
                }
            }
        })
        .boxed())
    }
}
