//! Serves reflection (v1 and v1alpha) and health on loopback, as every duet service does, and
//! checks what a descriptor-less client (grpcurl, ghz) sees: every service listed, and the
//! `duet.v1` descriptors resolvable by symbol.

use prost::Message;
use tonic::codegen::tokio_stream::{self, StreamExt};
use tonic::transport::{Channel, Server, server::TcpIncoming};
use tonic_reflection::pb::{v1, v1alpha};

async fn serve() -> Channel {
    let (reflection_v1, reflection_v1alpha) = duet_proto::reflection_services();
    let (health_reporter, health) = tonic_health::server::health_reporter();
    health_reporter
        .set_service_status("", tonic_health::ServingStatus::Serving)
        .await;
    let incoming = TcpIncoming::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = incoming.local_addr().unwrap();
    tokio::spawn(
        Server::builder()
            .add_service(health)
            .add_service(reflection_v1)
            .add_service(reflection_v1alpha)
            .serve_with_incoming(incoming),
    );
    Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap()
}

async fn ask_v1(
    channel: Channel,
    request: v1::server_reflection_request::MessageRequest,
) -> v1::server_reflection_response::MessageResponse {
    let mut client = v1::server_reflection_client::ServerReflectionClient::new(channel);
    let request = v1::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(request),
    };
    let mut responses = client
        .server_reflection_info(tokio_stream::iter([request]))
        .await
        .unwrap()
        .into_inner();
    responses
        .next()
        .await
        .unwrap()
        .unwrap()
        .message_response
        .unwrap()
}

const DUET_SERVICES: [&str; 5] = [
    "duet.v1.Generation",
    "duet.v1.DecodeWorker",
    "duet.v1.PrefillWorker",
    "duet.v1.KvTransfer",
    "duet.v1.WorkerControl",
];

#[tokio::test]
async fn v1_lists_every_service_and_resolves_symbols() {
    let channel = serve().await;

    let listed = ask_v1(
        channel.clone(),
        v1::server_reflection_request::MessageRequest::ListServices(String::new()),
    )
    .await;
    let v1::server_reflection_response::MessageResponse::ListServicesResponse(listed) = listed
    else {
        panic!("expected a service list, got {listed:?}");
    };
    let names: Vec<&str> = listed.service.iter().map(|s| s.name.as_str()).collect();
    for expected in DUET_SERVICES.iter().chain(&[
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
    ]) {
        assert!(names.contains(expected), "{expected} not in {names:?}");
    }

    // What grpcurl does before calling a method: fetch the file defining the symbol, then each
    // of its imports by file name (worker.proto imports generate.proto).
    let worker = file_descriptors(
        ask_v1(
            channel.clone(),
            v1::server_reflection_request::MessageRequest::FileContainingSymbol(
                "duet.v1.DecodeWorker".into(),
            ),
        )
        .await,
    );
    assert_eq!(worker[0].name(), "duet/v1/worker.proto");
    assert_eq!(worker[0].dependency, ["duet/v1/generate.proto"]);
    let generate = file_descriptors(
        ask_v1(
            channel,
            v1::server_reflection_request::MessageRequest::FileByFilename(
                "duet/v1/generate.proto".into(),
            ),
        )
        .await,
    );
    assert_eq!(generate[0].name(), "duet/v1/generate.proto");
    assert!(generate[0].service.iter().any(|s| s.name() == "Generation"));
}

fn file_descriptors(
    response: v1::server_reflection_response::MessageResponse,
) -> Vec<prost_types::FileDescriptorProto> {
    let v1::server_reflection_response::MessageResponse::FileDescriptorResponse(files) = response
    else {
        panic!("expected file descriptors, got {response:?}");
    };
    files
        .file_descriptor_proto
        .iter()
        .map(|bytes| prost_types::FileDescriptorProto::decode(bytes.as_slice()).unwrap())
        .collect()
}

#[tokio::test]
async fn v1alpha_lists_the_duet_services() {
    let channel = serve().await;
    let mut client = v1alpha::server_reflection_client::ServerReflectionClient::new(channel);
    let request = v1alpha::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(
            v1alpha::server_reflection_request::MessageRequest::ListServices(String::new()),
        ),
    };
    let response = client
        .server_reflection_info(tokio_stream::iter([request]))
        .await
        .unwrap()
        .into_inner()
        .next()
        .await
        .unwrap()
        .unwrap();
    let Some(v1alpha::server_reflection_response::MessageResponse::ListServicesResponse(listed)) =
        response.message_response
    else {
        panic!("expected a service list, got {response:?}");
    };
    let names: Vec<&str> = listed.service.iter().map(|s| s.name.as_str()).collect();
    for expected in DUET_SERVICES.iter().chain(&["grpc.health.v1.Health"]) {
        assert!(names.contains(expected), "{expected} not in {names:?}");
    }
}

#[tokio::test]
async fn health_answers_serving() {
    let channel = serve().await;
    let mut client = tonic_health::pb::health_client::HealthClient::new(channel);
    let status = client
        .check(tonic_health::pb::HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap()
        .into_inner()
        .status;
    assert_eq!(
        status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );
}
