//! Certificates for the tests, made with rcgen: a CA, and certificates it signs for 127.0.0.1
//! and localhost, usable as server and as client.

use std::path::{Path, PathBuf};

use duet_proto::TlsArgs;
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DistinguishedName, DnType,
    ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose,
};

/// A CA: its certificate written to `<dir>/<name>-ca.pem`.
pub struct Authority {
    issuer: CertifiedIssuer<'static, KeyPair>,
    pub ca: PathBuf,
}

impl Authority {
    pub fn new(dir: &Path, name: &str) -> Self {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name = common_name(&format!("{name} CA"));
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let issuer = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
        let ca = dir.join(format!("{name}-ca.pem"));
        std::fs::write(&ca, issuer.pem()).unwrap();
        Self { issuer, ca }
    }

    /// A certificate for 127.0.0.1 and localhost, as server and client, with its key; the TLS
    /// flags of a service that presents it.
    pub fn issue(&self, dir: &Path, name: &str) -> TlsArgs {
        let mut params =
            CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()]).unwrap();
        // Its own name: OpenSSL (the Python client) takes a certificate whose subject is its
        // issuer's for a self-signed one.
        params.distinguished_name = common_name(name);
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        let (cert_path, key_path) = (
            dir.join(format!("{name}-cert.pem")),
            dir.join(format!("{name}-key.pem")),
        );
        std::fs::write(&cert_path, cert.pem()).unwrap();
        std::fs::write(&key_path, key.serialize_pem()).unwrap();
        TlsArgs::new(cert_path, key_path, self.ca.clone())
    }
}

fn common_name(name: &str) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, name);
    dn
}
