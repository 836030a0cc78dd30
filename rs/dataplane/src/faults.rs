//! Test builds' hooks into the data plane (the `failpoints` feature, set through the
//! `FAILPOINTS` environment variable or a node's `FAILPOINTS_FILE`): a pause at a named point
//! ([`pause_point`]), a failure at one ([`fail_point`]), and a limit a test shortens
//! ([`tunable`]). In other builds each is nothing, and the data plane's files use them without
//! depending on one another for them.

use crate::status::ApiError;

/// Test builds: a pause at a named point of a move, set by a fail point `<name>=return(<ms>)`
/// (the `FAILPOINTS` environment variable), so that tests can kill a process inside a step.
pub(crate) async fn pause_point(name: &str) {
    #[cfg(feature = "failpoints")]
    if let Some(Some(ms)) = fail::eval(name, |arg| arg.and_then(|a| a.parse::<u64>().ok())) {
        tracing::warn!(point = name, ms, "pausing at a fail point");
        tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
    }
    #[cfg(not(feature = "failpoints"))]
    let _ = name;
}

/// Test builds: a failure at a named point of a move, set by a fail point `<name>=return`.
pub(crate) fn fail_point(name: &str) -> Result<(), ApiError> {
    #[cfg(feature = "failpoints")]
    if fail::eval(name, |_| ()).is_some() {
        return Err(ApiError::Unavailable(format!("fail point {name}")));
    }
    #[cfg(not(feature = "failpoints"))]
    let _ = name;
    Ok(())
}

/// `default`, or (test builds) the value the fail point `name` returns (`name=return(<n>)`).
pub(crate) fn tunable<T: std::str::FromStr>(name: &str, default: T) -> T {
    #[cfg(feature = "failpoints")]
    if let Some(Some(value)) = fail::eval(name, |arg| arg.and_then(|a| a.parse::<T>().ok())) {
        return value;
    }
    #[cfg(not(feature = "failpoints"))]
    let _ = name;
    default
}
