//! The fake kubelet's notion of now: the real monotonic clock plus an offset a test moves forward, so that
//! the kubelet's long waits (30 s until health is stale or a driver's slices are wiped, 5 s between health
//! streams, registration backoff) pass in an instant without sleeping.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;

/// A clock that tests can move forward; its timers fire when real time or an advance reaches them.
#[derive(Debug, Clone)]
pub(crate) struct Clock {
    offset: Arc<watch::Sender<Duration>>,
}

impl Clock {
    pub(crate) fn new() -> Self {
        Clock {
            offset: Arc::new(watch::Sender::new(Duration::ZERO)),
        }
    }

    /// Now, as the fake kubelet sees it.
    pub(crate) fn now(&self) -> Instant {
        Instant::now() + *self.offset.borrow()
    }

    /// Moves the clock forward by `by`; timers due by then fire.
    pub(crate) fn advance(&self, by: Duration) {
        self.offset.send_modify(|offset| *offset += by);
    }

    /// Follows the advances (to recompute what depends on time, like staleness).
    pub(crate) fn subscribe(&self) -> watch::Receiver<Duration> {
        self.offset.subscribe()
    }

    /// Waits until this clock reads `deadline` or later.
    pub(crate) async fn sleep_until(&self, deadline: Instant) {
        let mut advanced = self.offset.subscribe();
        loop {
            let now = self.now();
            if now >= deadline {
                return;
            }
            tokio::select! {
                () = tokio::time::sleep(deadline - now) => {}
                changed = advanced.changed() => {
                    if changed.is_err() {
                        // The clock is gone with the kubelet; real time alone is left.
                        tokio::time::sleep(deadline.saturating_duration_since(self.now())).await;
                        return;
                    }
                }
            }
        }
    }

    /// Waits for `duration` of this clock, counted from this call (not from the first poll).
    pub(crate) fn sleep(&self, duration: Duration) -> impl Future<Output = ()> + Send + 'static {
        let (clock, deadline) = (self.clone(), self.now() + duration);
        async move { clock.sleep_until(deadline).await }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_advance_fires_a_long_timer_at_once() {
        let clock = Clock::new();
        let timer = tokio::spawn(clock.sleep(Duration::from_secs(3600)));
        tokio::task::yield_now().await;
        assert!(!timer.is_finished());
        clock.advance(Duration::from_secs(3600));
        let fired = tokio::time::timeout(Duration::from_secs(5), timer).await;
        assert!(matches!(fired, Ok(Ok(()))), "{fired:?}");
    }
}
