//! Channels to peers: one lazily connected, reused channel per address (a channel multiplexes
//! calls and reconnects by itself), with Nagle's algorithm off as on the serving side, over TLS
//! with the service's own certificate when it has one ([`PeerAuth`]), and the cluster token and
//! the caller's trace context attached to every call ([`PeerMetadata`]).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tonic::metadata::{MetadataKey, MetadataMap, MetadataValue};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};

use crate::auth::{CLUSTER_TOKEN_HEADER, ClusterToken};

/// A channel to a peer whose calls carry [`PeerMetadata`].
pub type PeerChannel = InterceptedService<Channel, PeerMetadata>;

/// What every call to a peer carries: the cluster token (when there is one) and the W3C trace
/// context of the span the call is made in (when traces are exported), so the peer's spans join
/// the caller's trace.
#[derive(Clone, Debug, Default)]
pub struct PeerMetadata(pub Option<ClusterToken>);

impl tonic::service::Interceptor for PeerMetadata {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(token) = &self.0 {
            let value = token
                .as_str()
                .parse()
                .expect("a parsed token is visible ASCII");
            request.metadata_mut().insert(CLUSTER_TOKEN_HEADER, value);
        }
        duet_telemetry::traces::inject(&mut MetadataWriter(request.metadata_mut()));
        Ok(request)
    }
}

/// Writes a trace context into gRPC metadata.
struct MetadataWriter<'m>(&'m mut MetadataMap);

impl duet_telemetry::traces::Injector for MetadataWriter<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(key), Ok(value)) = (
            MetadataKey::from_bytes(key.as_bytes()),
            MetadataValue::try_from(value),
        ) {
            self.0.insert(key, value);
        }
    }
}

/// How long connecting to a peer may take before a call fails with UNAVAILABLE.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// A peer's address that is not a valid URI.
#[derive(Debug, thiserror::Error)]
#[error("{address:?} is not a valid address: {reason}")]
pub struct BadAddress {
    pub address: String,
    pub reason: String,
}

/// How a service's calls to its peers authenticate: the cluster token, and TLS (the CA that
/// signs peers' certificates and this service's own certificate, [`crate::Tls::client`]).
#[derive(Clone, Debug, Default)]
pub struct PeerAuth {
    pub token: Option<ClusterToken>,
    pub tls: Option<ClientTlsConfig>,
}

/// The endpoint at `address` (`host:port`, or a URI whose scheme is replaced): `https` with
/// `tls`, else `http`. Every channel to a peer or a router is dialled through here.
pub fn endpoint(address: &str, tls: Option<&ClientTlsConfig>) -> Result<Endpoint, BadAddress> {
    let authority = address.split_once("://").map_or(address, |(_, rest)| rest);
    let scheme = if tls.is_some() { "https" } else { "http" };
    let bad = |e: tonic::transport::Error| BadAddress {
        address: address.to_string(),
        reason: e.to_string(),
    };
    let endpoint = Endpoint::from_shared(format!("{scheme}://{authority}")).map_err(bad)?;
    match tls {
        Some(tls) => endpoint.tls_config(tls.clone()).map_err(bad),
        None => Ok(endpoint),
    }
}

/// What a channel may receive unread: per call, and over the connection. Fixed rather than
/// adaptive, because h2 closes a connection (GOAWAY `ENHANCE_YOUR_CALM`, `too_many_data_frames`)
/// once its unread small DATA frames pass a budget of half the connection window: adaptive
/// windows start at 64 KiB and grow only with bytes, so a token stream (one small frame a
/// token) read late by about 140 tokens would lose every call on its connection. 16 MiB makes
/// that about 35,000 tokens, and more than a KV pull's bandwidth-delay product in a cluster.
const STREAM_WINDOW_BYTES: u32 = 4 << 20;
const CONNECTION_WINDOW_BYTES: u32 = 16 << 20;

/// A lazily connected channel to `address` (`host:port`, or a URI) authenticated by `auth`.
pub fn channel(address: &str, auth: &PeerAuth) -> Result<PeerChannel, BadAddress> {
    let channel = endpoint(address, auth.tls.as_ref())?
        .connect_timeout(CONNECT_TIMEOUT)
        .tcp_nodelay(true)
        .initial_stream_window_size(STREAM_WINDOW_BYTES)
        .initial_connection_window_size(CONNECTION_WINDOW_BYTES)
        .connect_lazy();
    Ok(InterceptedService::new(
        channel,
        PeerMetadata(auth.token.clone()),
    ))
}

/// Whether a call failed because the peer refused the connection (nothing listens there: the
/// process is gone), as opposed to a slow or failing answer.
pub fn is_connection_refused(status: &tonic::Status) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(status);
    while let Some(e) = source {
        if let Some(io) = e.downcast_ref::<std::io::Error>()
            && io.kind() == std::io::ErrorKind::ConnectionRefused
        {
            return true;
        }
        source = e.source();
    }
    false
}

/// Channels to peers by address, made on first use and reused, authenticated by one
/// [`PeerAuth`].
#[derive(Debug, Default)]
pub struct Channels {
    auth: PeerAuth,
    by_address: Mutex<HashMap<String, PeerChannel>>,
}

impl Channels {
    pub fn new(auth: PeerAuth) -> Self {
        Self {
            auth,
            by_address: Mutex::default(),
        }
    }

    /// The channel to `address`, made now if this is the first call for it.
    pub fn get(&self, address: &str) -> Result<PeerChannel, BadAddress> {
        let mut map = self.by_address.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = map.get(address) {
            return Ok(c.clone());
        }
        let c = channel(address, &self.auth)?;
        map.insert(address.to_string(), c.clone());
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn one_channel_per_address_and_bad_addresses_are_named() {
        let channels = Channels::default();
        channels.get("127.0.0.1:1").unwrap();
        channels.get("127.0.0.1:1").unwrap();
        channels.get("http://127.0.0.1:2").unwrap();
        assert_eq!(channels.by_address.lock().unwrap().len(), 2);
        let err = channels.get("bad address with spaces").unwrap_err();
        assert!(err.to_string().contains("bad address with spaces"), "{err}");
    }

    /// A decode worker streaming one token a message, a millisecond apart (each message its
    /// own DATA frame, as an engine's steps make them).
    struct OneTokenAMessage(u32);

    #[tonic::async_trait]
    impl crate::v1::decode_worker_server::DecodeWorker for OneTokenAMessage {
        type DecodeStream =
            futures::stream::BoxStream<'static, Result<crate::v1::DecodeResponse, tonic::Status>>;

        async fn decode(
            &self,
            _: tonic::Request<crate::v1::DecodeRequest>,
        ) -> Result<tonic::Response<Self::DecodeStream>, tonic::Status> {
            let n = self.0;
            let tokens = futures::stream::unfold(0, move |i| async move {
                (i < n).then_some(())?;
                tokio::time::sleep(Duration::from_millis(1)).await;
                let message = crate::v1::DecodeResponse {
                    token_ids: vec![i],
                    ..Default::default()
                };
                Some((Ok(message), i + 1))
            });
            Ok(tonic::Response::new(Box::pin(tokens)))
        }
    }

    #[tokio::test]
    async fn a_token_stream_read_late_keeps_its_connection() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(crate::v1::decode_worker_server::DecodeWorkerServer::new(
                    OneTokenAMessage(600),
                ))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        let mut client = crate::v1::decode_worker_client::DecodeWorkerClient::new(
            channel(&address.to_string(), &PeerAuth::default()).unwrap(),
        );
        let mut stream = client
            .decode(crate::v1::DecodeRequest::default())
            .await
            .unwrap()
            .into_inner();
        // A reader held up (a router whose cores are busy): all 600 small frames arrive before
        // it reads the first. h2 closes a connection whose unread small frames pass its budget
        // (GOAWAY ENHANCE_YOUR_CALM, `too_many_data_frames`), which a 64 KiB window puts at
        // about 140 of them.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let mut tokens = Vec::new();
        while let Some(message) = stream.message().await.unwrap() {
            tokens.extend(message.token_ids);
        }
        assert_eq!(tokens, (0..600).collect::<Vec<_>>());
    }

    #[tokio::test]
    async fn a_refused_connection_is_told_apart_from_a_failed_call() {
        // A port that was just free: nothing listens there.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut client = tonic_health::pb::health_client::HealthClient::new(
            channel(&format!("127.0.0.1:{port}"), &PeerAuth::default()).unwrap(),
        );
        let status = client
            .check(tonic_health::pb::HealthCheckRequest::default())
            .await
            .unwrap_err();
        assert!(is_connection_refused(&status), "{status:?}");
        assert!(!is_connection_refused(&tonic::Status::unavailable("slow")));
    }
}
