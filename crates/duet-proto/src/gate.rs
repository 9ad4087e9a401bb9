//! A gate in front of some of an edge's services: while it is open their calls are admitted and
//! counted until they end (a stream until its last message); while it is closed they are refused
//! with UNAVAILABLE, which callers take as "try another worker". A worker whose role can change
//! serves both roles' services behind one gate each, and switches by closing one gate, waiting
//! until what it admitted has finished ([`Gate::drained`]), and opening the other.

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::{Request, Response};
use tokio::sync::watch;
use tonic::body::Body;
use tonic::server::NamedService;
use tower::Service;

use crate::serve::{BoxFuture, Holding};

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct GateState {
    open: bool,
    in_flight: usize,
}

/// See the module. Clones share one gate.
#[derive(Clone, Debug)]
pub struct Gate {
    /// What the refusal says the gated services are (`"prefill"`).
    what: &'static str,
    state: Arc<watch::Sender<GateState>>,
}

/// An admitted call's pass: counted in flight until dropped.
#[derive(Debug)]
pub struct GatePass(Arc<watch::Sender<GateState>>);

impl Drop for GatePass {
    fn drop(&mut self) {
        self.0.send_modify(|s| s.in_flight -= 1);
    }
}

impl Gate {
    /// A gate for the services of `what`, open or not.
    pub fn new(what: &'static str, open: bool) -> Self {
        Self {
            what,
            state: Arc::new(watch::Sender::new(GateState { open, in_flight: 0 })),
        }
    }

    pub fn is_open(&self) -> bool {
        self.state.borrow().open
    }

    pub fn open(&self) {
        self.state.send_modify(|s| s.open = true);
    }

    /// Stops admitting calls; those in flight go on.
    pub fn close(&self) {
        self.state.send_modify(|s| s.open = false);
    }

    /// Calls admitted and not yet finished.
    pub fn in_flight(&self) -> usize {
        self.state.borrow().in_flight
    }

    /// Admits one call if the gate is open (checked and counted at once, so a call admitted
    /// just before [`Gate::close`] is one [`Gate::drained`] waits for).
    pub fn admit(&self) -> Option<GatePass> {
        self.state
            .send_if_modified(|s| {
                s.in_flight += usize::from(s.open);
                s.open
            })
            .then(|| GatePass(self.state.clone()))
    }

    /// Waits until no admitted call is in flight: `false` if some still were after `timeout`.
    pub async fn drained(&self, timeout: Duration) -> bool {
        let mut rx = self.state.subscribe();
        tokio::time::timeout(timeout, rx.wait_for(|s| s.in_flight == 0))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    /// `service` behind this gate.
    pub fn wrap<S>(&self, service: S) -> Gated<S> {
        Gated {
            inner: service,
            gate: self.clone(),
        }
    }
}

/// A service behind a [`Gate`].
#[derive(Clone, Debug)]
pub struct Gated<S> {
    inner: S,
    gate: Gate,
}

impl<S: NamedService> NamedService for Gated<S> {
    const NAME: &'static str = S::NAME;
}

impl<S> Service<Request<Body>> for Gated<S>
where
    S: Service<Request<Body>, Response = Response<Body>, Error = Infallible>,
    S::Future: Send + 'static,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Response<Body>, Infallible>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        let Some(pass) = self.gate.admit() else {
            let status = tonic::Status::unavailable(format!(
                "this worker is not serving as a {} worker now (its role is switching or \
                 switched); try another",
                self.gate.what
            ));
            return Box::pin(std::future::ready(Ok(status.into_http())));
        };
        let response = self.inner.call(request);
        Box::pin(async move {
            let response = response.await?;
            Ok(response.map(|body| Holding::body(body, pass)))
        })
    }
}

#[cfg(test)]
mod tests {
    use std::pin::Pin;

    use super::*;

    /// A response stream that has not ended.
    struct Streaming;

    impl http_body::Body for Streaming {
        type Data = bytes::Bytes;
        type Error = tonic::Status;

        fn poll_frame(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
            Poll::Pending
        }
    }

    #[tokio::test]
    async fn a_closed_gate_admits_nothing_and_drains_once_every_pass_is_dropped() {
        let gate = Gate::new("prefill", true);
        let first = gate.admit().expect("open");
        let second = gate.admit().expect("open");
        assert_eq!(gate.in_flight(), 2);
        gate.close();
        assert!(gate.admit().is_none(), "closed: refused");
        assert_eq!(gate.in_flight(), 2, "a refusal is not counted");
        assert!(!gate.drained(Duration::from_millis(20)).await);
        drop(first);
        let waiting = tokio::spawn({
            let gate = gate.clone();
            async move { gate.drained(Duration::from_secs(5)).await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiting.is_finished(), "one call still in flight");
        drop(second);
        assert!(waiting.await.unwrap());
        gate.open();
        assert!(gate.admit().is_some());
    }

    #[tokio::test]
    async fn a_refused_call_is_unavailable_and_an_admitted_stream_counts_until_its_body_drops() {
        let gate = Gate::new("decode", false);
        let mut gated = gate.wrap(tower::service_fn(|_: Request<Body>| async {
            Ok::<_, Infallible>(Response::new(Body::new(Streaming)))
        }));
        let refused = gated.call(Request::new(Body::empty())).await.unwrap();
        assert_eq!(
            refused.headers().get("grpc-status").unwrap(),
            &(tonic::Code::Unavailable as i32).to_string()
        );
        gate.open();
        let admitted = gated.call(Request::new(Body::empty())).await.unwrap();
        assert_eq!(gate.in_flight(), 1, "the body is still open");
        drop(admitted);
        assert_eq!(gate.in_flight(), 0);
    }
}
