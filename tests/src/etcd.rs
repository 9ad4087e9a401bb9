//! A real etcd server (Debian's `etcd-server`, installed by `.ci/run`) on loopback, on free
//! ports, with its data in a temporary directory; it can be stopped and started again on the
//! same ports and data. [`Etcd::start_with_tls`] serves its clients over TLS and requires a
//! client certificate signed by its CA (`--client-cert-auth`).

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use duet_proto::TlsArgs;

use crate::free_addr;

pub struct Etcd {
    client: SocketAddr,
    peer: SocketAddr,
    dir: tempfile::TempDir,
    child: Option<Child>,
    /// Its certificate, key and CA (client certificates must be signed by that CA); also what
    /// [`Etcd::ctl`] presents.
    tls: Option<TlsArgs>,
}

impl Etcd {
    /// Starts etcd and waits until it answers.
    pub fn start() -> Etcd {
        Self::start_secured(None)
    }

    /// Starts etcd serving clients over TLS with `tls` (a certificate for 127.0.0.1, its key,
    /// its CA), requiring client certificates signed by that CA.
    pub fn start_with_tls(tls: TlsArgs) -> Etcd {
        Self::start_secured(Some(tls))
    }

    fn start_secured(tls: Option<TlsArgs>) -> Etcd {
        let mut etcd = Etcd {
            client: free_addr(),
            peer: free_addr(),
            dir: tempfile::tempdir().unwrap(),
            child: None,
            tls,
        };
        etcd.start_again();
        etcd
    }

    /// `http://127.0.0.1:<port>`, or `https://` when it serves TLS.
    pub fn url(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://{}", self.client)
    }

    /// Stops the server (SIGKILL: as abrupt as a crash).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts it again on the same ports and data and waits until it answers.
    pub fn start_again(&mut self) {
        assert!(self.child.is_none(), "etcd is running");
        let peer = format!("http://{}", self.peer);
        let mut command = Command::new("etcd");
        if let Some(tls) = &self.tls {
            command
                .arg("--cert-file")
                .arg(tls.tls_cert.as_ref().unwrap())
                .arg("--key-file")
                .arg(tls.tls_key.as_ref().unwrap())
                .arg("--trusted-ca-file")
                .arg(tls.tls_ca.as_ref().unwrap())
                .arg("--client-cert-auth");
        }
        let child = command
            .args(["--name", "duet-test", "--data-dir"])
            .arg(self.dir.path())
            .args(["--listen-client-urls", &self.url()])
            .args(["--advertise-client-urls", &self.url()])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("duet-test={peer}")])
            .args(["--logger", "zap", "--log-level", "error"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting etcd: install Debian's etcd-server (.ci/run does)");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.ctl(&["endpoint", "health"]).is_err() {
            assert!(Instant::now() < deadline, "etcd did not answer within 30 s");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Runs `etcdctl` against this server (presenting its own certificate when it serves TLS);
    /// its standard output, or its error.
    pub fn ctl(&self, args: &[&str]) -> Result<String, String> {
        let mut auth: Vec<String> = Vec::new();
        if let Some(tls) = &self.tls {
            let path = |p: &Option<std::path::PathBuf>| p.as_ref().unwrap().display().to_string();
            auth = vec![
                format!("--cacert={}", path(&tls.tls_ca)),
                format!("--cert={}", path(&tls.tls_cert)),
                format!("--key={}", path(&tls.tls_key)),
            ];
        }
        let auth: Vec<&str> = auth.iter().map(String::as_str).collect();
        self.ctl_as(&auth, args)
    }

    /// Runs `etcdctl` with only the connection flags in `auth` (`--cacert`, `--user`, ...).
    pub fn ctl_as(&self, auth: &[&str], args: &[&str]) -> Result<String, String> {
        let out = Command::new("etcdctl")
            .env("ETCDCTL_API", "3")
            .args(["--endpoints", &self.url(), "--command-timeout", "3s"])
            .args(auth)
            .args(args)
            .output()
            .map_err(|e| format!("running etcdctl (install etcd-client): {e}"))?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).into_owned())
        }
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.stop();
    }
}
