//! Accelerator probing. With the `cuda` feature the CUDA driver is loaded at run time
//! (cudarc's dynamic loading), so the binary builds and runs on machines without CUDA: the
//! library is looked for before any CUDA call (cudarc panics instead of returning an error
//! when it is missing), a missing library or device means CPU, and a panic from the driver
//! binding is caught as a last line of defence.
//!
//! Engines compute on the CPU today; the probe reports what a GPU-backed tier or engine
//! would have.

/// Where compute can run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Accelerator {
    Cpu { reason: String },
    Cuda { ordinal: usize, devices: usize },
}

impl std::fmt::Display for Accelerator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Accelerator::Cpu { reason } => write!(f, "cpu ({reason})"),
            Accelerator::Cuda { ordinal, devices } => write!(f, "cuda:{ordinal} of {devices}"),
        }
    }
}

/// Find a usable GPU, or say why there is none. Never panics.
pub fn probe() -> Accelerator {
    #[cfg(feature = "cuda")]
    {
        cuda::probe()
    }
    #[cfg(not(feature = "cuda"))]
    {
        Accelerator::Cpu {
            reason: "built without the cuda feature".into(),
        }
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::Accelerator;

    pub fn probe() -> Accelerator {
        // SAFETY: `is_culib_present` only attempts to dlopen the CUDA driver library and
        // reports whether it succeeded; it calls no CUDA function.
        let present = unsafe { cudarc::driver::sys::is_culib_present() };
        if !present {
            return Accelerator::Cpu {
                reason: "the CUDA driver library (libcuda) is not installed".into(),
            };
        }
        let attempt = std::panic::catch_unwind(|| {
            let devices = cudarc::driver::CudaContext::device_count()?;
            let _ctx = cudarc::driver::CudaContext::new(0)?;
            Ok::<_, cudarc::driver::DriverError>(devices)
        });
        match attempt {
            Ok(Ok(devices)) if devices > 0 => Accelerator::Cuda {
                ordinal: 0,
                devices: devices as usize,
            },
            Ok(Ok(_)) => Accelerator::Cpu {
                reason: "no CUDA device".into(),
            },
            Ok(Err(e)) => Accelerator::Cpu {
                reason: format!("CUDA unavailable: {e}"),
            },
            Err(_) => Accelerator::Cpu {
                reason: "the CUDA driver binding panicked".into(),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn probing_never_panics_and_names_a_reason_on_cpu() {
        match super::probe() {
            super::Accelerator::Cpu { reason } => assert!(!reason.is_empty()),
            // On a GPU machine (CACHET_EXPECT_GPU=1) the probe must find it.
            super::Accelerator::Cuda { devices, .. } => assert!(devices > 0),
        }
        if std::env::var_os("CACHET_EXPECT_GPU").is_some() {
            assert!(
                matches!(super::probe(), super::Accelerator::Cuda { .. }),
                "a GPU was expected"
            );
        }
    }
}
