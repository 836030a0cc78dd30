//! The one error type of the client: a gRPC status code and the server's message, kept as sent.

use std::fmt;

/// What kind of failure an [`Error`] is: the gRPC status code the server (or the transport)
/// answered with. tarn's codes and what they mean are listed in the server's README; the ones
/// worth retrying are [`Code::Unavailable`] and [`Code::ResourceExhausted`] (see
/// [`Error::is_retryable`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Code {
    /// The call was cancelled.
    Cancelled,
    /// An error with no better code (also: a status code this client does not know).
    Unknown,
    /// A request field is wrong; the message names it.
    InvalidArgument,
    /// The call's deadline passed (set with [`crate::ClientBuilder::timeout`] or per call).
    DeadlineExceeded,
    /// The collection does not exist.
    NotFound,
    /// The collection already exists.
    AlreadyExists,
    /// The API key is read-only.
    PermissionDenied,
    /// Too many writes in flight on the server, or its disk is full.
    ResourceExhausted,
    /// The request cannot be served in the server's current state.
    FailedPrecondition,
    /// The operation was aborted.
    Aborted,
    /// A value is out of range.
    OutOfRange,
    /// The server does not implement this call (an older server).
    Unimplemented,
    /// A bug or unexpected failure on the server.
    Internal,
    /// The server cannot be reached, or a collection's log refuses writes until a restart.
    Unavailable,
    /// Stored data is damaged.
    DataLoss,
    /// No API key, or an unknown one.
    Unauthenticated,
}

impl Code {
    fn from_tonic(code: tonic::Code) -> Code {
        match code {
            tonic::Code::Cancelled => Code::Cancelled,
            tonic::Code::InvalidArgument => Code::InvalidArgument,
            tonic::Code::DeadlineExceeded => Code::DeadlineExceeded,
            tonic::Code::NotFound => Code::NotFound,
            tonic::Code::AlreadyExists => Code::AlreadyExists,
            tonic::Code::PermissionDenied => Code::PermissionDenied,
            tonic::Code::ResourceExhausted => Code::ResourceExhausted,
            tonic::Code::FailedPrecondition => Code::FailedPrecondition,
            tonic::Code::Aborted => Code::Aborted,
            tonic::Code::OutOfRange => Code::OutOfRange,
            tonic::Code::Unimplemented => Code::Unimplemented,
            tonic::Code::Internal => Code::Internal,
            tonic::Code::Unavailable => Code::Unavailable,
            tonic::Code::DataLoss => Code::DataLoss,
            tonic::Code::Unauthenticated => Code::Unauthenticated,
            tonic::Code::Ok | tonic::Code::Unknown => Code::Unknown,
        }
    }

    /// The gRPC name of the code, as in `INVALID_ARGUMENT`.
    pub fn as_str(self) -> &'static str {
        match self {
            Code::Cancelled => "CANCELLED",
            Code::Unknown => "UNKNOWN",
            Code::InvalidArgument => "INVALID_ARGUMENT",
            Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
            Code::NotFound => "NOT_FOUND",
            Code::AlreadyExists => "ALREADY_EXISTS",
            Code::PermissionDenied => "PERMISSION_DENIED",
            Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
            Code::FailedPrecondition => "FAILED_PRECONDITION",
            Code::Aborted => "ABORTED",
            Code::OutOfRange => "OUT_OF_RANGE",
            Code::Unimplemented => "UNIMPLEMENTED",
            Code::Internal => "INTERNAL",
            Code::Unavailable => "UNAVAILABLE",
            Code::DataLoss => "DATA_LOSS",
            Code::Unauthenticated => "UNAUTHENTICATED",
        }
    }
}

impl fmt::Display for Code {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A failed call: the status code and the message, as the server sent them (or as the client
/// made them up for a failure of its own: a bad address, a connection refused, a deadline).
///
/// ```
/// use tarn_client::{Code, Error};
/// let error = Error::new(Code::NotFound, "collection 'docs' not found");
/// assert_eq!(error.code(), Code::NotFound);
/// assert_eq!(error.to_string(), "NOT_FOUND: collection 'docs' not found");
/// assert!(!error.is_retryable());
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct Error {
    code: Code,
    message: String,
    /// The server's hint on an overload answer (`retry-after-ms` metadata).
    retry_after: Option<std::time::Duration>,
}

impl Error {
    /// An error with this code and message.
    pub fn new(code: Code, message: impl Into<String>) -> Error {
        Error {
            code,
            message: message.into(),
            retry_after: None,
        }
    }

    /// How long the server asked the caller to wait before sending the same call again, when
    /// it refused it for overload (RESOURCE_EXHAUSTED with `retry-after-ms` metadata).
    /// [`retry_overloaded`] honours it.
    pub fn retry_after(&self) -> Option<std::time::Duration> {
        self.retry_after
    }

    /// The status code.
    pub fn code(&self) -> Code {
        self.code
    }

    /// The message: for an error from the server, its text exactly (it names the field or the
    /// collection at fault).
    pub fn message(&self) -> &str {
        &self.message
    }

    /// Whether the same call may succeed later unchanged: the server was unreachable or
    /// overloaded. A write that failed this way may or may not have been logged (the answer
    /// may have been lost), so retrying an insert is safe (it is an upsert) and retrying a
    /// remove is too.
    pub fn is_retryable(&self) -> bool {
        matches!(self.code, Code::Unavailable | Code::ResourceExhausted)
    }

    pub(crate) fn invalid(field: &str, reason: impl fmt::Display) -> Error {
        Error::new(Code::InvalidArgument, format!("{field}: {reason}"))
    }
}

impl From<tonic::Status> for Error {
    fn from(status: tonic::Status) -> Error {
        let message = if status.message().is_empty() {
            // Transport failures come with an empty message and the cause as the source.
            match std::error::Error::source(&status) {
                Some(source) => source.to_string(),
                None => status.code().description().to_owned(),
            }
        } else {
            status.message().to_owned()
        };
        // A connection that broke mid-call comes back from tonic as UNKNOWN or CANCELLED with
        // the transport error as its source: for the caller, the server became unreachable.
        let code = match status.code() {
            // The call's own deadline (`grpc-timeout`, enforced here too) ran out.
            tonic::Code::Cancelled if status.message() == "Timeout expired" => {
                Code::DeadlineExceeded
            }
            tonic::Code::Unknown | tonic::Code::Cancelled
                if std::error::Error::source(&status).is_some() =>
            {
                Code::Unavailable
            }
            // A stream the peer reset or a connection that went away under HTTP/2 (the server
            // killed mid-call, seen by the nemesis) comes back as INTERNAL with a message tonic
            // makes locally from the hyper error ("h2 protocol error: ..."; tonic's
            // `Status::from_hyper_error` attaches no source): unreachable too, not a bug of the
            // server's. A tarn server never sends a status with that message.
            tonic::Code::Internal if status.message().starts_with(H2_TRANSPORT_ERROR) => {
                Code::Unavailable
            }
            code => Code::from_tonic(code),
        };
        let retry_after = status
            .metadata()
            .get(RETRY_AFTER_MS)
            .and_then(|value| value.to_str().ok()?.parse::<u64>().ok())
            .map(std::time::Duration::from_millis);
        Error {
            retry_after,
            ..Error::new(code, message)
        }
    }
}

/// How tonic's messages for HTTP/2 transport failures begin.
const H2_TRANSPORT_ERROR: &str = "h2 protocol error:";

/// The metadata key of the server's retry hint, in milliseconds.
pub const RETRY_AFTER_MS: &str = "retry-after-ms";

/// Runs `call` and, while it fails with an overload answer that carries a retry hint, waits as
/// long as the hint says and runs it again, up to `max_retries` times; any other result is
/// returned at once. Opt-in: the client itself never retries. Inserts and removes are safe to
/// repeat (an insert is an upsert).
///
/// ```no_run
/// # async fn example(client: tarn_client::Client) -> tarn_client::Result<()> {
/// let seq = tarn_client::retry_overloaded(5, || client.flush("docs")).await?;
/// # Ok(()) }
/// ```
pub async fn retry_overloaded<T, F, Fut>(max_retries: usize, mut call: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T>>,
{
    let mut n_retries = 0;
    loop {
        match call().await {
            Err(error) if n_retries < max_retries && error.code == Code::ResourceExhausted => {
                let Some(wait) = error.retry_after else {
                    return Err(error);
                };
                n_retries += 1;
                tokio::time::sleep(wait).await;
            }
            result => return result,
        }
    }
}

/// The client's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn overloaded(hint_ms: Option<&str>) -> Error {
        let mut status = tonic::Status::resource_exhausted("too many writes in flight (1)");
        if let Some(hint) = hint_ms {
            status
                .metadata_mut()
                .insert(RETRY_AFTER_MS, hint.parse().unwrap());
        }
        Error::from(status)
    }

    #[test]
    fn a_broken_http2_stream_is_unavailable_and_other_internal_errors_stay_internal() {
        let broken = Error::from(tonic::Status::internal("h2 protocol error: http2 error"));
        assert_eq!(broken.code(), Code::Unavailable);
        assert!(broken.is_retryable());
        assert_eq!(broken.message(), "h2 protocol error: http2 error");
        let internal = Error::from(tonic::Status::internal("ingestion failed: disk full"));
        assert_eq!(internal.code(), Code::Internal);
    }

    #[test]
    fn the_hint_is_read_from_the_status_metadata() {
        assert_eq!(
            overloaded(Some("50")).retry_after(),
            Some(Duration::from_millis(50))
        );
        assert_eq!(overloaded(None).retry_after(), None);
        assert_eq!(overloaded(Some("soon")).retry_after(), None);
        assert!(overloaded(Some("50")).is_retryable());
    }

    #[tokio::test]
    async fn retry_overloaded_follows_hints_and_stops_at_anything_else() {
        let calls = std::cell::Cell::new(0);
        let result = retry_overloaded(5, || {
            calls.set(calls.get() + 1);
            let n = calls.get();
            async move {
                if n < 3 {
                    Err(overloaded(Some("1")))
                } else {
                    Ok(n)
                }
            }
        })
        .await;
        assert_eq!(result, Ok(3));
        // The retries are bounded.
        calls.set(0);
        let result: Result<()> = retry_overloaded(2, || {
            calls.set(calls.get() + 1);
            async { Err(overloaded(Some("1"))) }
        })
        .await;
        assert_eq!(result.unwrap_err().code(), Code::ResourceExhausted);
        assert_eq!(calls.get(), 3);
        // Without a hint, or for another code, no retry.
        for error in [overloaded(None), Error::new(Code::Unavailable, "down")] {
            calls.set(0);
            let result: Result<()> = retry_overloaded(5, || {
                calls.set(calls.get() + 1);
                let error = error.clone();
                async move { Err(error) }
            })
            .await;
            assert!(result.is_err());
            assert_eq!(calls.get(), 1);
        }
    }
}
