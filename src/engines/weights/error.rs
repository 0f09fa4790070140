//! [`FileError`]: an error about one file of a checkpoint (its path, the
//! system's errno), carried inside [`crate::base::error::Error::Io`].

use std::path::{Path, PathBuf};

/// An error about one file: its path, what went wrong, and the system's
/// errno where the system gave one. Carried inside [`crate::base::error::Error::Io`]
/// (`std::io::Error::get_ref` downcasts to it), whose kind is the error's.
#[derive(Debug)]
pub struct FileError {
    /// The file.
    pub path: PathBuf,
    /// What went wrong (the system's text for a system error).
    pub detail: String,
    /// The system's error number, if any.
    pub errno: Option<i32>,
}

impl std::fmt::Display for FileError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.path.display(), self.detail)
    }
}

impl std::error::Error for FileError {}

impl FileError {
    /// An error of `kind` about `path`.
    pub(crate) fn error(
        path: &Path,
        kind: std::io::ErrorKind,
        detail: String,
    ) -> crate::base::error::Error {
        std::io::Error::new(
            kind,
            FileError {
                path: path.to_path_buf(),
                detail,
                errno: None,
            },
        )
        .into()
    }

    /// The system's error `e` about `path`.
    pub(crate) fn io(path: &Path, e: std::io::Error) -> crate::base::error::Error {
        FileError::wrap(path, &e)
    }

    /// The system's error `e` about `path` (its kind, errno and text).
    pub(crate) fn wrap(path: &Path, e: &std::io::Error) -> crate::base::error::Error {
        let errno = e.raw_os_error();
        let mut detail = e.to_string();
        if let Some(code) = errno {
            if let Some(s) = detail.strip_suffix(&format!(" (os error {code})")) {
                detail = s.to_string();
            }
        }
        std::io::Error::new(
            e.kind(),
            FileError {
                path: path.to_path_buf(),
                detail,
                errno,
            },
        )
        .into()
    }

    /// The `FileError` inside `e`, if it carries one.
    pub fn of(e: &crate::base::error::Error) -> Option<&FileError> {
        match e {
            crate::base::error::Error::Io(io) => {
                io.get_ref().and_then(|r| r.downcast_ref::<FileError>())
            }
            _ => None,
        }
    }
}
