//! Where models live and how commands find the default one.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use clap::Args;

/// No model where one was asked for (or the default model is not fetched yet).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ModelNotFound(pub String);

/// The default model: file name inside the models directory.
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

#[derive(Args, Clone, Debug, PartialEq)]
pub struct ModelArgs {
    /// Model to load: a GGUF file or a Hugging Face directory (config.json, *.safetensors,
    /// tokenizer.json). Defaults to the fetched default model.
    #[arg(long, env = "DUET_MODEL")]
    pub model: Option<PathBuf>,
    /// Directory holding fetched models.
    #[arg(long, env = "DUET_MODELS_DIR", default_value_os_t = ModelArgs::default().models_dir)]
    pub models_dir: PathBuf,
}

impl Default for ModelArgs {
    fn default() -> Self {
        Self {
            model: None,
            models_dir: "models".into(),
        }
    }
}

impl ModelArgs {
    /// The model path to load, or an error that says how to get the default model.
    pub fn resolve(&self) -> Result<PathBuf, ModelNotFound> {
        match &self.model {
            Some(p) if p.exists() => Ok(p.clone()),
            Some(p) => Err(ModelNotFound(format!(
                "model {} does not exist",
                p.display()
            ))),
            None => default_model(&self.models_dir),
        }
    }

    /// These options as the flags above: parsed back, they give `self` (paths go as they are,
    /// not through UTF-8).
    pub fn to_args(&self) -> Vec<OsString> {
        let Self { model, models_dir } = self;
        let mut args = Vec::new();
        if let Some(model) = model {
            args.push(flag_path("--model=", model));
        }
        args.push(flag_path("--models-dir=", models_dir));
        args
    }
}

fn flag_path(flag: &str, path: &Path) -> OsString {
    let mut arg = OsString::from(flag);
    arg.push(path);
    arg
}

/// The default model in this checkout's `models/`, for the tests that run it. A missing model fails
/// them with the command that fetches it: a test never skips.
pub fn checkout_default_model() -> PathBuf {
    default_model(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models"))
        .unwrap_or_else(|e| panic!("{e}"))
}

pub fn default_model(models_dir: &Path) -> Result<PathBuf, ModelNotFound> {
    let path = models_dir.join(DEFAULT_MODEL_FILE);
    if path.exists() {
        return Ok(path);
    }
    Err(ModelNotFound(format!(
        "the default model is not installed (looked for {}); fetch it with `duet model fetch`{}",
        path.display(),
        if models_dir == Path::new("models") {
            String::new()
        } else {
            format!(" --models-dir {}", models_dir.display())
        }
    )))
}

/// The model's name as Info and the metrics' `model` label show it: the file stem of its path.
pub fn model_name(path: &Path) -> String {
    path.file_stem()
        .or_else(|| path.file_name())
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string())
}
