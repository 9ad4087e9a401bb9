//! A real etcd server (Debian's `etcd-server`, installed by `.ci/run`) on loopback, on free
//! ports, with its data in a temporary directory; it can be stopped and started again on the
//! same ports and data.

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::free_addr;

pub struct Etcd {
    client: SocketAddr,
    peer: SocketAddr,
    dir: tempfile::TempDir,
    child: Option<Child>,
}

impl Etcd {
    /// Starts etcd and waits until it answers.
    pub fn start() -> Etcd {
        let mut etcd = Etcd {
            client: free_addr(),
            peer: free_addr(),
            dir: tempfile::tempdir().unwrap(),
            child: None,
        };
        etcd.start_again();
        etcd
    }

    /// `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://{}", self.client)
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
        let child = Command::new("etcd")
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

    /// Runs `etcdctl` against this server; its standard output, or its error.
    pub fn ctl(&self, args: &[&str]) -> Result<String, String> {
        let out = Command::new("etcdctl")
            .env("ETCDCTL_API", "3")
            .args(["--endpoints", &self.url(), "--command-timeout", "3s"])
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
