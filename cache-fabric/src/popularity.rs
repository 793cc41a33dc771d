//! How often a block was pulled lately: the count behind hot-block replication (a node that
//! pulls a block often enough keeps an extra replica of it). Used by [`crate::cluster`] with
//! the runtime's clock and by the fleet simulator with simulated time, so both decide "hot"
//! by the same rule.

use std::collections::HashMap;
use std::hash::Hash;
use std::ops::{Add, Sub};
use std::time::Duration;

/// Sliding-window counts per key: two fixed windows, the previous one weighted by how much
/// of it still overlaps the sliding window (the usual rate-limiter approximation). `T` is a
/// point in time: an `Instant`, or a `Duration` since a simulation's start.
#[derive(Debug)]
pub struct Popularity<K, T> {
    started: Option<T>,
    current: HashMap<K, u32>,
    previous: HashMap<K, u32>,
}

impl<K, T> Default for Popularity<K, T> {
    fn default() -> Self {
        Self {
            started: None,
            current: HashMap::new(),
            previous: HashMap::new(),
        }
    }
}

impl<K, T> Popularity<K, T>
where
    K: Hash + Eq,
    T: Copy + Ord + Sub<Output = Duration> + Add<Duration, Output = T>,
{
    /// Count one use of `key` at `now`; returns its uses within the last `window`.
    pub fn record(&mut self, key: K, now: T, window: Duration) -> f64 {
        let since = |t: T| if now > t { now - t } else { Duration::ZERO };
        let started = *self.started.get_or_insert(now);
        let elapsed = since(started);
        if elapsed >= window * 2 {
            self.previous.clear();
            self.current.clear();
            self.started = Some(now);
        } else if elapsed >= window {
            self.previous = std::mem::take(&mut self.current);
            self.started = Some(started + window);
        }
        let into =
            since(self.started.unwrap_or(now)).as_secs_f64() / window.as_secs_f64().max(1e-9);
        let previous = self.previous.get(&key).copied().unwrap_or(0);
        let n = self.current.entry(key).or_default();
        *n += 1;
        f64::from(*n) + f64::from(previous) * (1.0 - into).max(0.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uses_fade_out_of_the_window() {
        let w = Duration::from_secs(10);
        let mut p = Popularity::<u64, Duration>::default();
        let s = Duration::from_secs;
        assert_eq!(p.record(1, s(0), w), 1.0);
        assert_eq!(p.record(1, s(1), w), 2.0);
        assert_eq!(p.record(2, s(2), w), 1.0);
        // Half into the next window: the previous window's two uses count half.
        assert_eq!(p.record(1, s(15), w), 2.0);
        // Two windows later nothing is left.
        assert_eq!(p.record(1, s(40), w), 1.0);
    }
}
