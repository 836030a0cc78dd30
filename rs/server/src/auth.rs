//! Optional API keys: `authorization: Bearer <key>` metadata; read-write and read-only keys.

use std::collections::HashSet;

use tonic::Request;

use tarn_dataplane::ApiError;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    Read,
    Write,
}

/// The API key a request carries (`authorization: Bearer <key>`), if any: a cluster router
/// forwards calls to other nodes with the caller's own key.
pub fn api_key<T>(request: &Request<T>) -> Option<String> {
    request
        .metadata()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::to_owned)
}

/// No keys configured = auth off (every request allowed).
#[derive(Debug, Clone, Default)]
pub struct ApiKeys {
    read_write: HashSet<String>,
    read_only: HashSet<String>,
}

impl ApiKeys {
    pub fn new(read_write: &[String], read_only: &[String]) -> Self {
        ApiKeys {
            read_write: read_write
                .iter()
                .filter(|k| !k.is_empty())
                .cloned()
                .collect(),
            read_only: read_only
                .iter()
                .filter(|k| !k.is_empty())
                .cloned()
                .collect(),
        }
    }

    pub fn enabled(&self) -> bool {
        !self.read_write.is_empty() || !self.read_only.is_empty()
    }

    pub fn check<T>(&self, request: &Request<T>, access: Access) -> Result<(), ApiError> {
        if !self.enabled() {
            return Ok(());
        }
        let key = request
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .ok_or(ApiError::Unauthenticated)?;
        if self.read_write.contains(key) {
            Ok(())
        } else if self.read_only.contains(key) {
            match access {
                Access::Read => Ok(()),
                Access::Write => Err(ApiError::PermissionDenied),
            }
        } else {
            Err(ApiError::Unauthenticated)
        }
    }
}
