//! TLS (`--tls-cert`, `--tls-key`, `--tls-ca`): a disaggregated cluster of separate processes
//! serves with mutual TLS between its services (router → decode, decode → prefill, the KV push
//! prefill → decode, stats polls), its router's public port serves TLS to a client without a
//! certificate, and a worker's internal port refuses a plaintext client, a TLS client without a
//! certificate and one whose certificate another CA signed, while the cluster's own certificate
//! is let through. The router's HTTP port serves HTTPS to the official `openai` client trusting
//! the CA, while a client stalled in its handshake waits alone. Certificates are made with rcgen
//! ([`duet_tests::certs`]).

use duet_proto::{PeerAuth, TlsArgs, v1};
use duet_tests::certs::Authority;
use duet_tests::*;
use tonic::transport::ClientTlsConfig;

/// The official client against the HTTPS port: argv is the cluster's CA, another CA, the port's
/// address and the model's name.
const OPENAI_OVER_HTTPS: &str = r#"
import ssl, sys, openai
ca, other_ca, addr, model = sys.argv[1:]
def client(scheme, trusted):
    verify = ssl.create_default_context(cafile=trusted)
    return openai.OpenAI(base_url=f"{scheme}://{addr}/v1", api_key="unused", max_retries=0,
                         timeout=60, http_client=openai.DefaultHttpxClient(verify=verify))
done = client("https", ca).completions.create(model=model, prompt="hello", max_tokens=4)
assert done.usage.completion_tokens >= 1, done
for who, refused in [("plaintext", client("http", ca)), ("another CA", client("https", other_ca))]:
    try:
        refused.models.list()
        sys.exit(f"a {who} client got an answer from the HTTPS port")
    except openai.APIConnectionError:
        pass
"#;

/// A worker's `Stats` through `tls` (`None`: plaintext), with the cluster token.
async fn stats(
    c: &Cluster,
    worker: std::net::SocketAddr,
    tls: Option<ClientTlsConfig>,
) -> Result<v1::StatsResponse, tonic::Status> {
    let auth = PeerAuth {
        token: Some(c.token.clone()),
        tls,
    };
    let channel = duet_proto::channel(&worker.to_string(), &auth).unwrap();
    v1::worker_control_client::WorkerControlClient::new(channel)
        .stats(v1::StatsRequest {})
        .await
        .map(tonic::Response::into_inner)
}

/// Whether a call failed in the connection (TLS handshake, HTTP/2 framing), never reaching a
/// service: a server's own answer carries no transport error.
fn refused_by_the_connection(status: &tonic::Status) -> bool {
    let mut source = std::error::Error::source(status);
    while let Some(e) = source {
        if e.is::<tonic::transport::Error>() {
            return true;
        }
        source = e.source();
    }
    false
}

#[test]
fn a_cluster_with_mutual_tls_serves_and_its_workers_refuse_callers_without_its_certificates() {
    let dir = tempfile::tempdir().unwrap();
    let cluster_ca = Authority::new(dir.path(), "cluster");
    let tls = cluster_ca.issue(dir.path(), "service");
    // Every prefill runs on the prefill worker, so its KV is pushed to the decode worker.
    let mut spec = spec(tiny_model(), 1, 1, local_prefill_threshold(0));
    spec.processes = true;
    spec.bin_dir = Some(bin_dir());
    spec.router.tls = tls.clone();
    let http = free_addr();
    spec.router.http_listen = Some(http);
    spec.prefill.worker.tls = tls.clone();
    spec.decode.worker.tls = tls.clone();
    let c = Cluster::start(&spec).unwrap();
    let own = tls.load().unwrap().unwrap().client();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        // (a) The public port: TLS, no client certificate needed.
        let public = duet_proto::tls::client_trusting(&cluster_ca.ca).unwrap();
        let channel = duet_proto::channels::endpoint(&c.router.to_string(), Some(&public))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut client = v1::generation_client::GenerationClient::new(channel);
        let prompt: Vec<u32> = (0..40).map(|i| 10 + i).collect();
        let mut stream = client
            .generate(greedy_request(&prompt, 6))
            .await
            .unwrap()
            .into_inner();
        let mut tokens = 0;
        while let Some(message) = stream.message().await.unwrap() {
            tokens += message.token_ids.len();
        }
        assert!(tokens > 0, "no tokens over TLS");
        // The KV went from the prefill worker to the decode worker over mutual TLS.
        let decode = stats(&c, c.decode[0], Some(own.clone())).await.unwrap();
        let prefill = stats(&c, c.prefill[0], Some(own.clone())).await.unwrap();
        assert!(decode.transfer_bytes_in > 0, "{decode:?}");
        assert!(prefill.transfer_bytes_out > 0, "{prefill:?}");
        // And a plaintext client of the router is refused.
        let plain = duet_proto::channels::endpoint(&c.router.to_string(), None)
            .unwrap()
            .connect_lazy();
        let refused = v1::generation_client::GenerationClient::new(plain)
            .info(v1::InfoRequest {})
            .await
            .unwrap_err();
        assert!(refused_by_the_connection(&refused), "{refused:?}");

        // (d) The HTTP port: HTTPS to the official client, while a connection that never
        // handshakes stays open beside it; plaintext and a client trusting another CA are refused.
        let _stalled = std::net::TcpStream::connect(http).unwrap();
        let stranger = Authority::new(dir.path(), "stranger");
        let status = std::process::Command::new("python3")
            .args(["-c", OPENAI_OVER_HTTPS])
            .arg(&cluster_ca.ca)
            .arg(&stranger.ca)
            .arg(http.to_string())
            .arg(duet_router::model_name(&tiny_model()))
            .status()
            .expect("python3 (with PyPI `openai`, which scripts/test.sh installs)");
        assert!(status.success(), "the openai client over HTTPS failed");
        // (b) A worker's internal port: plaintext, and TLS without a client certificate, are
        // refused before any call is served.
        let foreign = Authority::new(dir.path(), "foreign").issue(dir.path(), "intruder");
        let intruder = ClientTlsConfig::new()
            .ca_certificate(tonic::transport::Certificate::from_pem(
                std::fs::read(&cluster_ca.ca).unwrap(),
            ))
            .identity(tonic::transport::Identity::from_pem(
                std::fs::read(foreign.tls_cert.unwrap()).unwrap(),
                std::fs::read(foreign.tls_key.unwrap()).unwrap(),
            ));
        for worker in [c.decode[0], c.prefill[0]] {
            for (who, tls) in [
                ("a plaintext client", None),
                ("a TLS client without a certificate", Some(public.clone())),
                // (c) A certificate that another CA signed.
                (
                    "a client with another CA's certificate",
                    Some(intruder.clone()),
                ),
            ] {
                let status = stats(&c, worker, tls).await.expect_err(who);
                assert!(refused_by_the_connection(&status), "{who}: {status:?}");
            }
        }
    });
    // (e) `duet health`, the exec probe of a worker whose port requires a client certificate:
    // SERVING with the cluster's certificate, a failure without one.
    let health = |worker: std::net::SocketAddr, with_certificate: bool| {
        let mut probe = std::process::Command::new(bin_dir().join("duet"));
        probe
            .args(["health", "--server", &worker.to_string(), "--tls-ca"])
            .arg(&cluster_ca.ca);
        if with_certificate {
            probe
                .arg("--tls-cert")
                .arg(tls.tls_cert.as_ref().unwrap())
                .arg("--tls-key")
                .arg(tls.tls_key.as_ref().unwrap());
        }
        probe.output().unwrap()
    };
    for worker in [c.decode[0], c.prefill[0]] {
        let ok = health(worker, true);
        assert!(ok.status.success(), "{ok:?}");
        assert_eq!(String::from_utf8_lossy(&ok.stdout).trim(), "SERVING");
        let refused = health(worker, false);
        assert!(!refused.status.success(), "{refused:?}");
    }
}

#[test]
fn a_key_that_does_not_match_the_certificate_is_a_startup_error_naming_both_files() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Authority::new(dir.path(), "cluster");
    let first = ca.issue(dir.path(), "first");
    let second = ca.issue(dir.path(), "second");
    let mixed = TlsArgs {
        tls_key: second.tls_key.clone(),
        ..first.clone()
    };
    let err = mixed.load().unwrap_err().to_string();
    assert!(
        err.contains("second-key.pem") && err.contains("first-cert.pem"),
        "{err}"
    );
    assert!(first.load().unwrap().is_some());
}
