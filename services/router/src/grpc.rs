//! The public `duet.v1.Generation` service, the gRPC front: Generate (the core's messages as a
//! stream), Complete (the same, gathered into one message), Tokenize and Info, each through the
//! core's door ([`Core`]). Calls are admitted against the in-flight limit by the edge, before a
//! handler runs.

use std::sync::Arc;

use duet_proto::v1;
use duet_proto::v1::generation_server::Generation;
use futures::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use crate::door::{Core, Item, RouterState, gather};

/// The `Generation` service.
#[derive(Clone, Debug)]
pub struct GenerationService {
    state: Arc<RouterState>,
}

impl GenerationService {
    pub fn new(state: Arc<RouterState>) -> Self {
        Self { state }
    }
}

#[tonic::async_trait]
impl Generation for GenerationService {
    type GenerateStream = futures::stream::Map<
        ReceiverStream<Item>,
        fn(Item) -> Result<v1::GenerateResponse, Status>,
    >;

    async fn generate(
        &self,
        request: Request<v1::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let deadline = duet_proto::deadline(&request);
        let rx = self.state.start(request.into_inner(), deadline).await?;
        let stream: fn(Item) -> Result<v1::GenerateResponse, Status> =
            |item| item.map_err(Status::from);
        Ok(Response::new(ReceiverStream::new(rx).map(stream)))
    }

    async fn complete(
        &self,
        request: Request<v1::GenerateRequest>,
    ) -> Result<Response<v1::GenerateResponse>, Status> {
        let deadline = duet_proto::deadline(&request);
        let rx = self.state.start(request.into_inner(), deadline).await?;
        Ok(Response::new(gather(rx).await?))
    }

    async fn tokenize(
        &self,
        request: Request<v1::TokenizeRequest>,
    ) -> Result<Response<v1::TokenizeResponse>, Status> {
        Ok(Response::new(
            self.state.tokenize(request.into_inner()).await?,
        ))
    }

    async fn info(
        &self,
        _request: Request<v1::InfoRequest>,
    ) -> Result<Response<v1::InfoResponse>, Status> {
        Ok(Response::new(self.state.info()))
    }
}
