//! The environment a build reads, as a snapshot (a test gives its own).

use crate::{error::Error, error::Result};
use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::PathBuf;

/// A snapshot of the environment variables the builder reads.
#[derive(Clone, Debug, Default)]
pub struct Env {
    vars: BTreeMap<String, OsString>,
}

impl Env {
    /// This process's environment (a variable with a non-UTF-8 name is kept
    /// under its lossy name, so it is still cleared when it should be).
    pub fn process() -> Env {
        Env {
            vars: std::env::vars_os()
                .map(|(k, v)| (k.to_string_lossy().into_owned(), v))
                .collect(),
        }
    }

    /// An environment of the given pairs only (for tests).
    pub fn from_pairs<'a>(pairs: impl IntoIterator<Item = (&'a str, &'a str)>) -> Env {
        Env {
            vars: pairs
                .into_iter()
                .map(|(k, v)| (k.to_string(), v.into()))
                .collect(),
        }
    }

    /// A variable's value, when it is UTF-8.
    pub fn var(&self, key: &str) -> Option<String> {
        self.vars
            .get(key)
            .and_then(|v| v.to_str())
            .map(String::from)
    }

    /// Every variable's name.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.vars.keys().map(String::as_str)
    }

    /// A path variable (any bytes).
    pub(crate) fn path(&self, var: &'static str) -> Result<PathBuf> {
        self.vars
            .get(var)
            .map(PathBuf::from)
            .ok_or(Error::NotInBuildScript { var })
    }
}
