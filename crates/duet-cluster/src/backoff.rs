//! Waiting between tries to reach the registry.

use std::time::Duration;

/// Longest wait between two tries.
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// Exponential backoff from 100 ms up to [`MAX_BACKOFF`].
pub(crate) struct Backoff(Duration);

impl Backoff {
    pub(crate) fn new() -> Self {
        Self(Duration::from_millis(100))
    }

    pub(crate) async fn wait(&mut self) {
        tokio::time::sleep(self.0).await;
        self.0 = (self.0 * 2).min(MAX_BACKOFF);
    }
}
