//! Which device an engine runs on (`--device cpu|cuda[:N]`), and the on/off switches of its
//! device paths (`--cuda-graphs on|off`, ...).

use std::fmt;
use std::str::FromStr;

/// Tokens a forward step computes on a CPU unless told otherwise: costs no prefill speed and keeps
/// a step's activations small.
pub const CPU_STEP_TOKENS: usize = 128;
/// Tokens a forward step computes on a GPU unless told otherwise: a prompt chunk that fills the
/// tensor cores (`duet bench gpu`'s mixed-load measurement times the decodes beside each size).
pub const GPU_STEP_TOKENS: usize = 2048;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Device {
    #[default]
    Cpu,
    /// A CUDA GPU by ordinal.
    Cuda(usize),
}

impl Device {
    /// The step token budget this device gets when none is asked for.
    pub fn step_tokens(self) -> usize {
        match self {
            Self::Cpu => CPU_STEP_TOKENS,
            Self::Cuda(_) => GPU_STEP_TOKENS,
        }
    }
}

impl FromStr for Device {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda(0)),
            other => match other.strip_prefix("cuda:") {
                Some(n) => n.parse().map(Self::Cuda).map_err(|_| {
                    format!(
                        "bad GPU ordinal {n:?} in device {other:?}: expected cuda:N, N = 0, 1, ..."
                    )
                }),
                None => Err(format!(
                    "unknown device {other:?}: expected cpu, cuda or cuda:N"
                )),
            },
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Cpu => f.write_str("cpu"),
            Self::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// How a GPU holds GGUF weights of a block format (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
pub enum GpuWeights {
    /// Dequantized to bf16 at load.
    #[default]
    Bf16,
    /// Kept as the file's blocks, dequantized in registers by the matrix kernels.
    Packed,
}

impl fmt::Display for GpuWeights {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Bf16 => "bf16",
            Self::Packed => "packed",
        })
    }
}

/// A switch on the command line: `on` or `off`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
pub enum Switch {
    On,
    #[default]
    Off,
}

impl Switch {
    pub fn is_on(self) -> bool {
        self == Self::On
    }
}

impl fmt::Display for Switch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.is_on() { "on" } else { "off" })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints() {
        for (s, d) in [
            ("cpu", Device::Cpu),
            ("cuda", Device::Cuda(0)),
            ("cuda:3", Device::Cuda(3)),
        ] {
            assert_eq!(s.parse::<Device>().unwrap(), d);
        }
        assert_eq!(Device::Cuda(1).to_string(), "cuda:1");
        assert_eq!(
            Device::Cpu.to_string().parse::<Device>().unwrap(),
            Device::Cpu
        );
    }

    #[test]
    fn a_gpu_gets_a_larger_step_budget_than_a_cpu() {
        assert_eq!(Device::Cpu.step_tokens(), 128);
        assert_eq!(Device::Cuda(1).step_tokens(), 2048);
    }

    #[test]
    fn rejects_bad_devices_with_the_expected_forms() {
        for bad in ["gpu", "cuda:", "cuda:-1", "cuda:x", "CPU", ""] {
            let err = bad.parse::<Device>().unwrap_err();
            assert!(err.contains("cuda:N"), "{bad}: {err}");
        }
    }
}
