//! The duet gRPC protocol.
//!
//! [`v1`] holds the messages, clients and servers generated from `proto/duet/v1`:
//! the public `Generation` service (`generate.proto`) and the internal worker services
//! `DecodeWorker`, `PrefillWorker`, `KvTransfer`, `KvEvents`, `WorkerControl` and `WorkerAdmin` (`worker.proto`).
//! The `.proto` comments are the API documentation and appear on the generated items.
//!
//! [`FILE_DESCRIPTOR_SET`] is the encoded descriptor set of those files, and
//! [`reflection_services`] builds the v1 and v1alpha server-reflection services that describe
//! them together with `grpc.health.v1`, so `grpcurl` and `ghz` work with no `.proto` file.
//!
//! [`serve`] is every service's edge (deadline, in-flight limit, health, reflection), and
//! [`convert`] the one place protocol messages become the model's request types and back.

/// Messages, clients (`*_client`) and servers (`*_server`) of package `duet.v1`.
#[allow(
    clippy::all,
    clippy::pedantic,
    missing_docs,
    rustdoc::bare_urls,
    rustdoc::broken_intra_doc_links,
    rustdoc::invalid_html_tags
)]
pub mod v1 {
    tonic::include_proto!("duet.v1");
}

pub mod auth;
pub mod channels;
pub mod convert;
pub mod gate;
pub mod malformed;
pub mod serve;
pub mod tls;

pub use auth::{ClusterAuth, ClusterToken};
pub use channels::{Channels, PeerAuth, PeerChannel, PeerMetadata, channel, is_connection_refused};
pub use gate::{Gate, GatePass, Gated};
pub use serve::{
    DrainBegun, Draining, Edge, EdgeOptions, InFlightLimitLayer, MAX_MESSAGE_BYTES, Overloaded,
    deadline,
};
pub use tls::{Tls, TlsArgs};

/// `KvHeader.layout` of a KV push: per (layer, block), K then V, each
/// `[kv_head][slot][head_dim]`, little-endian values of `KvHeader.dtype`.
pub const KV_WIRE_LAYOUT: &str = "duet-kv-v1";

use tonic_reflection::server::v1::{ServerReflection, ServerReflectionServer};
use tonic_reflection::server::v1alpha::{
    ServerReflection as ServerReflectionV1Alpha,
    ServerReflectionServer as ServerReflectionServerV1Alpha,
};

/// Encoded `google.protobuf.FileDescriptorSet` of `duet/v1/generate.proto` and
/// `duet/v1/worker.proto`.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/duet_v1_descriptor.bin"));

/// Builds the gRPC server-reflection services, v1 and v1alpha (older grpcurl/ghz ask for
/// v1alpha), describing every `duet.v1` service, `grpc.health.v1.Health` and reflection itself.
///
/// Add both to a tonic server, next to a health service (`tonic_health::server::health_reporter`).
pub fn reflection_services() -> (
    ServerReflectionServer<impl ServerReflection>,
    ServerReflectionServerV1Alpha<impl ServerReflectionV1Alpha>,
) {
    const MSG: &str = "descriptor sets compiled into duet-proto are valid";
    let v1 = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .expect(MSG);
    let v1alpha = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1alpha()
        .expect(MSG);
    (v1, v1alpha)
}

/// Connections accepted on `listener`, with Nagle's algorithm off: token streams are many small
/// messages, and delayed ACKs would otherwise add tens of milliseconds per hop.
pub fn incoming(listener: tokio::net::TcpListener) -> tonic::transport::server::TcpIncoming {
    tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true))
}

#[cfg(test)]
mod tests {
    use prost::Message;
    use prost_types::{FileDescriptorSet, ServiceDescriptorProto};

    use super::*;

    fn descriptor_set() -> FileDescriptorSet {
        FileDescriptorSet::decode(FILE_DESCRIPTOR_SET).expect("descriptor set decodes")
    }

    fn service(fds: &FileDescriptorSet, full_name: &str) -> ServiceDescriptorProto {
        fds.file
            .iter()
            .flat_map(|f| {
                f.service
                    .iter()
                    .map(move |s| (format!("{}.{}", f.package(), s.name()), s))
            })
            .find(|(name, _)| name == full_name)
            .map(|(_, s)| s.clone())
            .unwrap_or_else(|| panic!("service {full_name} missing from the descriptor set"))
    }

    /// (method name, client streaming, server streaming) of each method of a service.
    fn methods(s: &ServiceDescriptorProto) -> Vec<(String, bool, bool)> {
        s.method
            .iter()
            .map(|m| {
                (
                    m.name().to_string(),
                    m.client_streaming(),
                    m.server_streaming(),
                )
            })
            .collect()
    }

    fn m(name: &str, client_streaming: bool, server_streaming: bool) -> (String, bool, bool) {
        (name.to_string(), client_streaming, server_streaming)
    }

    #[test]
    fn descriptor_set_has_every_service_and_method() {
        let fds = descriptor_set();
        let files: Vec<&str> = fds.file.iter().map(|f| f.name()).collect();
        assert!(files.contains(&"duet/v1/generate.proto"), "{files:?}");
        assert!(files.contains(&"duet/v1/worker.proto"), "{files:?}");

        assert_eq!(
            methods(&service(&fds, "duet.v1.Generation")),
            [
                m("Generate", false, true),
                m("Complete", false, false),
                m("Tokenize", false, false),
                m("Info", false, false),
            ]
        );
        assert_eq!(
            methods(&service(&fds, "duet.v1.DecodeWorker")),
            [m("Decode", false, true)]
        );
        assert_eq!(
            methods(&service(&fds, "duet.v1.PrefillWorker")),
            [m("Prefill", false, false)]
        );
        assert_eq!(
            methods(&service(&fds, "duet.v1.KvTransfer")),
            [m("Push", true, false), m("Pull", false, true)]
        );
        assert_eq!(
            methods(&service(&fds, "duet.v1.WorkerControl")),
            [m("Stats", false, false)]
        );
        assert_eq!(
            methods(&service(&fds, "duet.v1.WorkerAdmin")),
            [m("SwitchRole", false, false)]
        );
        assert_eq!(
            methods(&service(&fds, "duet.v1.KvEvents")),
            [m("Subscribe", false, true)]
        );
    }

    #[test]
    fn descriptor_set_keeps_the_proto_comments() {
        // grpcurl `describe` shows these; they need source info in the descriptor set.
        let fds = descriptor_set();
        let generate = fds
            .file
            .iter()
            .find(|f| f.name() == "duet/v1/generate.proto")
            .unwrap();
        let info = generate.source_code_info.as_ref().expect("source info");
        assert!(info.location.iter().any(|l| {
            l.leading_comments()
                .contains("Maximum number of tokens to generate")
        }));
    }

    #[test]
    fn reflection_services_build() {
        let (_v1, _v1alpha) = reflection_services();
        // The health descriptor set we register is the one tonic-health serves.
        let health = FileDescriptorSet::decode(tonic_health::pb::FILE_DESCRIPTOR_SET).unwrap();
        assert!(
            health
                .file
                .iter()
                .any(|f| f.package() == "grpc.health.v1" && !f.service.is_empty())
        );
    }

    #[test]
    fn generated_types_round_trip() {
        let chunk = v1::KvChunk {
            kind: Some(v1::kv_chunk::Kind::Data(v1::KvData {
                layer: 3,
                block_start: 1,
                block_end: 2,
                payload: vec![1, 2, 3, 4],
                xxh3: 0xdead_beef_0123_4567,
            })),
        };
        let bytes = chunk.encode_to_vec();
        assert_eq!(v1::KvChunk::decode(bytes.as_slice()).unwrap(), chunk);

        let req = v1::GenerateRequest {
            prompt: "hi".into(),
            max_tokens: Some(0),
            ..Default::default()
        };
        let back = v1::GenerateRequest::decode(req.encode_to_vec().as_slice()).unwrap();
        // `optional` keeps an explicit 0 distinguishable from unset.
        assert_eq!(back.max_tokens, Some(0));
        assert_eq!(back.temperature, None);
        assert_eq!(
            v1::FinishReason::try_from(2).unwrap(),
            v1::FinishReason::Length
        );
    }
}
