//! Requests tonic cannot decode, answered as `generate.proto` promises: INVALID_ARGUMENT with a
//! message saying what was wrong. tonic itself answers a message past the size limit with
//! OUT_OF_RANGE and a message that is not valid protobuf (such as invalid UTF-8 in a string
//! field) with INTERNAL, before any handler runs; this layer rewrites those two answers.

use std::task::{Context, Poll};

use futures::TryFutureExt;
use futures::future::MapOk;
use http::{Request, Response};
use tonic::body::Body;
use tonic::{Code, Status};
use tower::{Layer, Service};

/// How tonic's decoder words a message past the size limit.
const TOO_LARGE: &str = "Error, decoded message length too large: ";
/// How prost's decode error begins (it then names the message and field, then the problem).
const NOT_PROTOBUF: &str = "failed to decode Protobuf message: ";

/// The status a malformed request should have been answered with, if `status` is tonic's own
/// answer to one.
fn invalid_argument(status: &Status) -> Option<Status> {
    let message = status.message();
    match status.code() {
        Code::OutOfRange => message.strip_prefix(TOO_LARGE).map(|size| {
            Status::invalid_argument(format!("the request message is too large: {size}"))
        }),
        Code::Internal => message.strip_prefix(NOT_PROTOBUF).map(|what| {
            Status::invalid_argument(format!("the request message is malformed: {what}"))
        }),
        _ => None,
    }
}

/// Rewrites a response that is tonic's answer to an undecodable request (a trailers-only
/// response: the status is in its headers).
fn rewrite(response: Response<Body>) -> Response<Body> {
    match Status::from_header_map(response.headers())
        .as_ref()
        .and_then(invalid_argument)
    {
        Some(status) => status.into_http(),
        None => response,
    }
}

/// Answers undecodable requests with INVALID_ARGUMENT (see the module docs).
#[derive(Clone, Copy, Debug, Default)]
pub struct MalformedRequestLayer;

impl<S> Layer<S> for MalformedRequestLayer {
    type Service = MalformedRequest<S>;

    fn layer(&self, inner: S) -> Self::Service {
        MalformedRequest { inner }
    }
}

#[derive(Clone, Debug)]
pub struct MalformedRequest<S> {
    inner: S,
}

type Rewrite = fn(Response<Body>) -> Response<Body>;

impl<S, B> Service<Request<B>> for MalformedRequest<S>
where
    S: Service<Request<B>, Response = Response<Body>>,
{
    type Response = Response<Body>;
    type Error = S::Error;
    type Future = MapOk<S::Future, Rewrite>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        self.inner.call(request).map_ok(rewrite as Rewrite)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_tonics_decoding_failures_are_rewritten() {
        let big = Status::out_of_range(
            "Error, decoded message length too large: found 5000000 bytes, the limit is: 4194304 bytes",
        );
        let s = invalid_argument(&big).unwrap();
        assert_eq!(s.code(), Code::InvalidArgument);
        assert!(
            s.message().contains("found 5000000 bytes"),
            "{}",
            s.message()
        );
        let utf8 = Status::internal(
            "failed to decode Protobuf message: GenerateRequest.prompt: invalid string value: data is not UTF-8 encoded",
        );
        let s = invalid_argument(&utf8).unwrap();
        assert_eq!(s.code(), Code::InvalidArgument);
        assert!(
            s.message().contains("GenerateRequest.prompt"),
            "{}",
            s.message()
        );
        assert!(invalid_argument(&Status::internal("engine failed")).is_none());
        assert!(invalid_argument(&Status::out_of_range("max_tokens")).is_none());
    }
}
