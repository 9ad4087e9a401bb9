//! TLS on every gRPC port, through rustls (ring provider): `--tls-cert`, `--tls-key` and
//! `--tls-ca` ([`TlsArgs`]) give a service its certificate and the CA of the cluster. Internal
//! ports (the workers') then require a client certificate signed by that CA (mutual TLS), and
//! every call to a peer presents the service's own certificate and checks the peer's against the
//! CA ([`Tls::client`]). The router's public ports (gRPC, and HTTPS through [`Tls::https`]) serve
//! TLS with the same certificate but ask no client certificate: clients authenticate with API keys.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

/// A TLS setting that cannot be used; each names the flag or file at fault.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error(
        "--tls-cert, --tls-key and --tls-ca go together: {missing} missing (set all three, or none for plaintext)"
    )]
    Partial { missing: String },
    #[error("reading {flag} {path}: {source}")]
    Read {
        flag: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{flag} {path} holds no usable PEM {what}: {reason}")]
    NotPem {
        flag: &'static str,
        path: PathBuf,
        what: &'static str,
        reason: String,
    },
    #[error("--tls-key {key} does not match the certificate in --tls-cert {cert}: {reason}")]
    KeyMismatch {
        key: PathBuf,
        cert: PathBuf,
        reason: String,
    },
}

/// The TLS flags every service takes (all three, or none: plaintext).
#[derive(clap::Args, Clone, Debug, Default, PartialEq)]
pub struct TlsArgs {
    /// PEM certificate (chain) this service presents, as server and as client of its peers.
    /// With --tls-key and --tls-ca: every gRPC port (and the router's HTTP port) serves TLS,
    /// worker ports require a client certificate signed by --tls-ca, and calls to peers dial
    /// https. Unset: plaintext.
    #[arg(long, env = "DUET_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, env = "DUET_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// PEM certificate of the CA that signs the cluster's certificates: peers' server
    /// certificates and the client certificates worker ports accept.
    #[arg(long, env = "DUET_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
}

/// A service's checked TLS material.
#[derive(Clone, Debug)]
pub struct Tls {
    identity: Identity,
    ca: Certificate,
    https: Arc<rustls::ServerConfig>,
}

impl TlsArgs {
    /// Uses `cert`, `key` and `ca`.
    pub fn new(cert: PathBuf, key: PathBuf, ca: PathBuf) -> Self {
        Self {
            tls_cert: Some(cert),
            tls_key: Some(key),
            tls_ca: Some(ca),
        }
    }

    /// The files read and checked (PEM, the key matches the certificate); `None`: plaintext.
    pub fn load(&self) -> Result<Option<Tls>, TlsError> {
        let (cert, key, ca) = match (&self.tls_cert, &self.tls_key, &self.tls_ca) {
            (None, None, None) => return Ok(None),
            (Some(cert), Some(key), Some(ca)) => (cert, key, ca),
            (cert, key, ca) => {
                let missing = [
                    (cert.is_none(), "--tls-cert"),
                    (key.is_none(), "--tls-key"),
                    (ca.is_none(), "--tls-ca"),
                ]
                .into_iter()
                .filter_map(|(absent, flag)| absent.then_some(flag))
                .collect::<Vec<_>>()
                .join(", ");
                return Err(TlsError::Partial { missing });
            }
        };
        let cert_pem = read("--tls-cert", cert)?;
        let key_pem = read("--tls-key", key)?;
        let chain = certificates("--tls-cert", cert, &cert_pem)?;
        let private_key =
            PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| TlsError::NotPem {
                flag: "--tls-key",
                path: key.clone(),
                what: "private key",
                reason: e.to_string(),
            })?;
        let key_mismatch = |e: rustls::Error| TlsError::KeyMismatch {
            key: key.clone(),
            cert: cert.clone(),
            reason: e.to_string(),
        };
        // Checks that the key is the certificate's, and is the HTTPS port's configuration.
        let mut https = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(key_mismatch)?
        .with_no_client_auth()
        .with_single_cert(chain, private_key)
        .map_err(key_mismatch)?;
        https.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Some(Tls {
            identity: Identity::from_pem(cert_pem, key_pem),
            ca: load_ca(ca)?,
            https: Arc::new(https),
        }))
    }

    /// The flags as a command line (paths only: the files hold the secrets).
    pub fn to_args(&self) -> Vec<OsString> {
        [
            ("--tls-cert=", &self.tls_cert),
            ("--tls-key=", &self.tls_key),
            ("--tls-ca=", &self.tls_ca),
        ]
        .into_iter()
        .filter_map(|(flag, path)| {
            path.as_ref().map(|p| {
                let mut arg = OsString::from(flag);
                arg.push(p);
                arg
            })
        })
        .collect()
    }
}

/// A client of a TLS server whose certificate the CA at `ca` (`--tls-ca`) signed, presenting
/// no certificate of its own (`duet generate --tls-ca`: the router's public port).
pub fn client_trusting(ca: &Path) -> Result<ClientTlsConfig, TlsError> {
    Ok(ClientTlsConfig::new().ca_certificate(load_ca(ca)?))
}

/// The CA certificate at `path` (`--tls-ca`), checked.
fn load_ca(path: &Path) -> Result<Certificate, TlsError> {
    let pem = read("--tls-ca", path)?;
    let mut roots = rustls::RootCertStore::empty();
    for der in certificates("--tls-ca", path, &pem)? {
        roots.add(der).map_err(|e| TlsError::NotPem {
            flag: "--tls-ca",
            path: path.to_path_buf(),
            what: "CA certificate",
            reason: e.to_string(),
        })?;
    }
    Ok(Certificate::from_pem(pem))
}

impl Tls {
    /// An internal port's TLS: a client certificate signed by the CA is required.
    pub fn server_requiring_client_certs(&self) -> ServerTlsConfig {
        ServerTlsConfig::new()
            .identity(self.identity.clone())
            .client_ca_root(self.ca.clone())
    }

    /// A public port's TLS: no client certificate asked (clients authenticate with API keys).
    pub fn server(&self) -> ServerTlsConfig {
        ServerTlsConfig::new().identity(self.identity.clone())
    }

    /// The router's HTTP port (HTTP/1.1 over TLS): no client certificate asked either.
    pub fn https(&self) -> Arc<rustls::ServerConfig> {
        self.https.clone()
    }

    /// Calls to peers: verify them against the CA, present this service's certificate.
    pub fn client(&self) -> ClientTlsConfig {
        ClientTlsConfig::new()
            .ca_certificate(self.ca.clone())
            .identity(self.identity.clone())
    }
}

fn read(flag: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        flag,
        path: path.to_path_buf(),
        source,
    })
}

/// The certificates of a PEM file; at least one.
fn certificates(
    flag: &'static str,
    path: &Path,
    pem: &[u8],
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let not_pem = |reason: String| TlsError::NotPem {
        flag,
        path: path.to_path_buf(),
        what: "certificate",
        reason,
    };
    let chain = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| not_pem(e.to_string()))?;
    if chain.is_empty() {
        return Err(not_pem("no CERTIFICATE block".into()));
    }
    Ok(chain)
}

/// Whether `certificate` (a peer's leaf certificate, DER) is valid for the host of `address`
/// (`host:port`, or a URI): its subject alternative names include that DNS name or IP address.
/// Only names are compared here; the chain was checked against the CA in the handshake.
pub fn certificate_names(certificate: &CertificateDer<'_>, address: &str) -> bool {
    let authority = address.split_once("://").map_or(address, |(_, rest)| rest);
    let authority = authority.split('/').next().unwrap_or(authority);
    let host = match authority.rsplit_once(':') {
        Some((host, port)) if port.bytes().all(|b| b.is_ascii_digit()) => host,
        _ => authority,
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let (Ok(name), Ok(cert)) = (
        rustls::pki_types::ServerName::try_from(host),
        webpki::EndEntityCert::try_from(certificate),
    ) else {
        return false;
    };
    cert.verify_is_valid_for_subject_name(&name).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_partial_set_names_what_is_missing() {
        let args = TlsArgs {
            tls_cert: Some("c.pem".into()),
            ..TlsArgs::default()
        };
        let err = args.load().unwrap_err().to_string();
        assert!(err.contains("--tls-key, --tls-ca missing"), "{err}");
        assert!(TlsArgs::default().load().unwrap().is_none());
    }

    #[test]
    fn bad_files_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let junk = dir.path().join("junk.pem");
        std::fs::write(&junk, "not a certificate").unwrap();
        let absent = dir.path().join("absent.pem");
        let err = TlsArgs::new(absent.clone(), junk.clone(), junk.clone())
            .load()
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("--tls-cert") && err.contains("absent.pem"),
            "{err}"
        );
        let err = TlsArgs::new(junk.clone(), junk.clone(), junk.clone())
            .load()
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("--tls-cert") && err.contains("junk.pem"),
            "{err}"
        );
        let err = client_trusting(&junk).unwrap_err().to_string();
        assert!(
            err.contains("--tls-ca") && err.contains("no usable PEM"),
            "{err}"
        );
    }

    #[test]
    fn the_command_line_carries_the_paths() {
        let args = TlsArgs::new("a b/c.pem".into(), "k.pem".into(), "ca.pem".into());
        assert_eq!(
            args.to_args(),
            ["--tls-cert=a b/c.pem", "--tls-key=k.pem", "--tls-ca=ca.pem"]
        );
        assert!(TlsArgs::default().to_args().is_empty());
    }

    #[test]
    fn a_certificate_names_the_hosts_of_its_subject_alternative_names() {
        let key = rcgen::KeyPair::generate().unwrap();
        let params = rcgen::CertificateParams::new(vec![
            "prefill-0.duet.svc".to_string(),
            "10.0.0.7".to_string(),
        ])
        .unwrap();
        let cert = params.self_signed(&key).unwrap();
        let der = cert.der();
        for named in [
            "prefill-0.duet.svc:50061",
            "10.0.0.7:50061",
            "https://10.0.0.7:1/x",
            "10.0.0.7",
        ] {
            assert!(certificate_names(der, named), "{named}");
        }
        for other in [
            "prefill-1.duet.svc:50061",
            "10.0.0.8:50061",
            "",
            "not a host:x",
        ] {
            assert!(!certificate_names(der, other), "{other}");
        }
    }
}
