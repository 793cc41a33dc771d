//! What a vLLM model's instances measure about their stages: how long a prefill stage takes
//! (a moving average) and the time between tokens against the decode batch it was measured
//! at (a decayed least-squares line), for [`cachet_common::stages::StageLoad`].

use std::sync::Mutex;
use std::time::Duration;

use cachet_common::stages::StepModel;

/// Weight of the newest prefill stage in the moving average.
const PREFILL_ALPHA: f64 = 0.2;
/// Each new decode observation scales the weight of those before it by this much: the line
/// follows the last hundred or so generations.
const STEP_DECAY: f64 = 0.98;
/// Observations (by decayed weight: three make 2.94) before the line is announced.
const STEP_MIN_WEIGHT: f64 = 2.9;
/// A spread of batches below this (variance) cannot give a slope: the line is flat at the
/// mean until the batches seen differ.
const STEP_MIN_VARIANCE: f64 = 0.05;

/// A model's stage measurements, shared by its generations.
#[derive(Debug, Default)]
pub struct StageMeter {
    inner: Mutex<Inner>,
    /// The model whose gauges it sets (none in tests).
    model: Option<String>,
}

#[derive(Debug, Default)]
struct Inner {
    prefill_ms: Option<f64>,
    fit: StepFit,
}

impl StageMeter {
    /// A meter that shows its measurements in `model`'s gauges.
    pub fn for_model(model: &str) -> Self {
        Self {
            model: Some(model.to_string()),
            ..Self::default()
        }
    }

    /// A prefill stage ended after `took`.
    pub fn prefilled(&self, took: Duration) {
        let ms = took.as_secs_f64() * 1e3;
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let avg = match g.prefill_ms {
            Some(avg) => avg + PREFILL_ALPHA * (ms - avg),
            None => ms,
        };
        g.prefill_ms = Some(avg);
        if let Some(m) = &self.model {
            crate::metrics::STAGE_PREFILL_SECONDS
                .with_label_values(&[m])
                .set(avg / 1e3);
        }
    }

    /// A generation decoded with a mean of `gap` between its tokens while `batch` generations
    /// (itself included) were on its instance.
    pub fn decoded(&self, batch: u32, gap: Duration) {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        g.fit.add(f64::from(batch.max(1)), gap.as_secs_f64() * 1e3);
        if let (Some(m), Some(line)) = (&self.model, g.fit.model()) {
            for (part, ms) in [("base", line.base_ms), ("per_seq", line.per_seq_ms)] {
                crate::metrics::STAGE_STEP_SECONDS
                    .with_label_values(&[m, part])
                    .set(ms / 1e3);
            }
        }
    }

    pub fn prefill_stage_ms(&self) -> Option<f64> {
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .prefill_ms
    }

    pub fn step(&self) -> Option<StepModel> {
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .fit
            .model()
    }
}

/// Decayed sums for a least-squares line `gap = base + per_seq × batch`.
#[derive(Debug, Default, Clone, Copy)]
struct StepFit {
    w: f64,
    sx: f64,
    sy: f64,
    sxx: f64,
    sxy: f64,
}

impl StepFit {
    fn add(&mut self, x: f64, y: f64) {
        if !(x.is_finite() && y.is_finite() && y >= 0.0) {
            return;
        }
        for s in [
            &mut self.w,
            &mut self.sx,
            &mut self.sy,
            &mut self.sxx,
            &mut self.sxy,
        ] {
            *s *= STEP_DECAY;
        }
        self.w += 1.0;
        self.sx += x;
        self.sy += y;
        self.sxx += x * x;
        self.sxy += x * y;
    }

    /// The line, never decreasing with the batch and never below zero; flat at the mean
    /// while every observation was at about the same batch.
    fn model(&self) -> Option<StepModel> {
        if self.w < STEP_MIN_WEIGHT {
            return None;
        }
        let (mx, my) = (self.sx / self.w, self.sy / self.w);
        let var = self.sxx / self.w - mx * mx;
        if var < STEP_MIN_VARIANCE {
            return Some(StepModel {
                base_ms: my,
                per_seq_ms: 0.0,
            });
        }
        let slope = ((self.sxy / self.w - mx * my) / var).max(0.0);
        let base = my - slope * mx;
        Some(if base >= 0.0 {
            StepModel {
                base_ms: base,
                per_seq_ms: slope,
            }
        } else {
            // Through the origin at the mean: the steepest line the data allows without a
            // negative base.
            StepModel {
                base_ms: 0.0,
                per_seq_ms: my / mx,
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: f64) -> Duration {
        Duration::from_secs_f64(v / 1e3)
    }

    #[test]
    fn the_line_is_fitted_to_batches_and_gaps() {
        let m = StageMeter::default();
        assert_eq!(m.step(), None);
        // Three observations are enough to announce a line.
        for _ in 0..2 {
            m.decoded(1, ms(30.0));
        }
        assert_eq!(m.step(), None);
        m.decoded(1, ms(30.0));
        assert!(m.step().is_some());
        let m = StageMeter::default();
        // 20 ms + 5 ms a sequence, exactly.
        for b in [1u32, 2, 3, 4, 1, 2, 3, 4] {
            m.decoded(b, ms(20.0 + 5.0 * f64::from(b)));
        }
        let s = m.step().unwrap();
        assert!((s.base_ms - 20.0).abs() < 1e-6, "{s:?}");
        assert!((s.per_seq_ms - 5.0).abs() < 1e-6, "{s:?}");
        assert_eq!(s.at(8), ms(60.0));
    }

    #[test]
    fn one_batch_size_gives_a_flat_line_and_never_a_falling_one() {
        let m = StageMeter::default();
        for _ in 0..5 {
            m.decoded(1, ms(30.0));
        }
        assert_eq!(
            m.step(),
            Some(StepModel {
                base_ms: 30.0,
                per_seq_ms: 0.0
            })
        );
        // Bigger batches faster (noise): flat, not negative.
        let m = StageMeter::default();
        for (b, g) in [(1, 40.0), (4, 30.0), (1, 40.0), (4, 30.0)] {
            m.decoded(b, ms(g));
        }
        assert_eq!(m.step().unwrap().per_seq_ms, 0.0);
        // Steep growth from a small batch: through the origin rather than a negative base.
        let m = StageMeter::default();
        for (b, g) in [(2, 2.0), (4, 40.0), (2, 2.0), (4, 40.0)] {
            m.decoded(b, ms(g));
        }
        let s = m.step().unwrap();
        assert_eq!(s.base_ms, 0.0);
        assert!(s.per_seq_ms > 0.0);
    }

    #[test]
    fn the_prefill_average_moves_toward_the_newest() {
        let m = StageMeter::default();
        assert_eq!(m.prefill_stage_ms(), None);
        m.prefilled(ms(100.0));
        m.prefilled(ms(200.0));
        assert!((m.prefill_stage_ms().unwrap() - 120.0).abs() < 1e-6);
        // The old observations fade.
        for _ in 0..100 {
            m.decoded(1, ms(10.0));
        }
        for _ in 0..300 {
            m.decoded(2, ms(50.0));
        }
        let s = m.step().unwrap();
        assert!(s.at(2) > ms(45.0), "{s:?}");
    }
}
