//! Where the tests find their data: the `testdata` folder of `shared/` (float64 references,
//! test models, tokenizer vectors), which stays out of the repository.
//!
//! The folder is `$KILN_TESTDATA` when that is set (the GPU bundle, or any other layout),
//! else `../shared/testdata` beside the workspace root. The shared folder (`shared/models`,
//! for instance) is its parent. A missing folder or file panics with one message that names
//! the path tried and `KILN_TESTDATA`.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// The variable that overrides the test data folder.
pub const VAR: &str = "KILN_TESTDATA";

/// The test data folder (`$KILN_TESTDATA`, an absolute path since cargo runs each test binary in its
/// crate's folder; else `<workspace>/../shared/testdata`); panics when it is absent.
#[track_caller]
pub fn dir() -> PathBuf {
    found(resolve_dir(std::env::var_os(VAR)))
}

/// `rel` inside the test data folder (a file or a folder), which must exist.
#[track_caller]
pub fn path(rel: &str) -> PathBuf {
    found(existing(dir().join(rel)))
}

/// `rel` inside the shared folder, the test data folder's parent (e.g. `models/stories260K.gguf`), which must exist.
#[track_caller]
pub fn shared_path(rel: &str) -> PathBuf {
    let dir = dir();
    found(existing(dir.parent().unwrap_or(&dir).join(rel)))
}

/// The path, or the one panic (reported at the test's call site) with the message.
#[track_caller]
fn found(path: Result<PathBuf, String>) -> PathBuf {
    match path {
        Ok(path) => path,
        Err(message) => panic!("{message}"),
    }
}

/// The folder `dir()` uses without the environment: `var` is the value of `KILN_TESTDATA`.
fn resolve_dir(var: Option<OsString>) -> Result<PathBuf, String> {
    let dir = match var.filter(|v| !v.is_empty()) {
        Some(v) => PathBuf::from(v),
        None => default_dir(),
    };
    if dir.is_dir() {
        Ok(dir)
    } else {
        Err(not_found(&dir))
    }
}

/// `<workspace root>/../shared/testdata`: this crate sits at `<workspace root>/crates/kiln-testdata`.
fn default_dir() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let beside_checkout = manifest.ancestors().nth(3).expect("crates/kiln-testdata sits two levels below the workspace root");
    beside_checkout.join("shared/testdata")
}

fn existing(path: PathBuf) -> Result<PathBuf, String> {
    if path.exists() {
        Ok(path)
    } else {
        Err(not_found(&path))
    }
}

fn not_found(path: &Path) -> String {
    format!("test data not found at {}: set {VAR} to the testdata folder (see README)", path.display())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_folder_names_the_path_and_the_variable() {
        let bogus = std::env::temp_dir().join("kiln-testdata-no-such-folder/testdata");
        let message = resolve_dir(Some(bogus.clone().into_os_string())).unwrap_err();
        assert_eq!(message, format!("test data not found at {}: set KILN_TESTDATA to the testdata folder (see README)", bogus.display()));
    }

    #[test]
    fn a_missing_file_names_its_path() {
        let dir = std::env::temp_dir();
        let message = existing(dir.join("kiln-testdata-no-such-file.gguf")).unwrap_err();
        assert!(message.starts_with(&format!("test data not found at {}", dir.join("kiln-testdata-no-such-file.gguf").display())), "{message}");
        assert!(message.contains("set KILN_TESTDATA"), "{message}");
    }

    #[test]
    fn the_variable_wins_and_an_empty_one_is_unset() {
        let dir = std::env::temp_dir();
        assert_eq!(resolve_dir(Some(dir.clone().into_os_string())), Ok(dir));
        assert_eq!(resolve_dir(Some(OsString::new())), resolve_dir(None));
    }

    #[test]
    fn the_default_is_beside_the_workspace_root() {
        let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).parent().and_then(Path::parent).unwrap();
        assert!(workspace.join("Cargo.toml").is_file() && workspace.join("crates/kiln-testdata").is_dir());
        assert_eq!(default_dir(), workspace.parent().unwrap().join("shared/testdata"));
    }
}
