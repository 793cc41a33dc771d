//! The loop of every periodic background job: run at once, then once a period (a run that
//! overruns delays the next instead of bunching them up), until a cancellation token fires.
//!
//! ```ignore
//! let mut tick = Ticker::new(every, stop);
//! while tick.next().await {
//!     work().await;
//! }
//! ```

use std::time::Duration;

use tokio::time::{Interval, MissedTickBehavior};
use tokio_util::sync::CancellationToken;

pub struct Ticker {
    interval: Interval,
    stop: CancellationToken,
}

impl Ticker {
    pub fn new(every: Duration, stop: CancellationToken) -> Self {
        let mut interval = tokio::time::interval(every);
        interval.set_missed_tick_behavior(MissedTickBehavior::Delay);
        Self { interval, stop }
    }

    /// Wait for the next run: `true` when it is due, `false` once stopped (a stop wins over a
    /// run due at the same moment).
    pub async fn next(&mut self) -> bool {
        tokio::select! {
            biased;
            _ = self.stop.cancelled() => false,
            _ = self.interval.tick() => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn runs_at_once_then_each_period_and_a_stop_wins_over_a_due_run() {
        let period = Duration::from_millis(100);
        let stop = CancellationToken::new();
        let mut tick = Ticker::new(period, stop.clone());
        assert!(tick.next().await, "the first run is at once");
        // The next is not due within half a period (a busy machine only makes it later).
        let early = tokio::time::timeout(period / 2, tick.next()).await;
        assert!(early.is_err(), "a run came before its period");
        assert!(tick.next().await);
        // A run is due and the ticker is stopped: it stops.
        tokio::time::sleep(period * 2).await;
        stop.cancel();
        assert!(!tick.next().await);
        assert!(!tick.next().await, "and stays stopped");
    }
}
