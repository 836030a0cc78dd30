//! Where a client connects: parsing an address (`host:port`, `http://host:port`,
//! `https://host:port`, `unix:/path`) and opening the channel over the matching transport.

use std::path::PathBuf;
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};

use crate::coalesce::Coalescing;
use crate::error::{Code, Error, Result};

/// A parsed server address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Address {
    /// `http://host:port`, or a bare `host:port`: plain HTTP/2 over TCP.
    Plain(String),
    /// `https://host:port`: TLS.
    Tls(String),
    /// `unix:/path`: a Unix socket on this machine.
    Unix(PathBuf),
}

impl Address {
    pub(crate) fn parse(address: &str) -> Result<Address> {
        let address = address.trim();
        if let Some(path) = address.strip_prefix("unix:") {
            if path.is_empty() {
                return Err(Error::invalid(
                    "address",
                    "`unix:` needs a socket path, as in unix:/run/tarn/tarn.sock",
                ));
            }
            return Ok(Address::Unix(PathBuf::from(path)));
        }
        if address.starts_with("http://") {
            return Ok(Address::Plain(address.to_owned()));
        }
        if address.starts_with("https://") {
            return Ok(Address::Tls(address.to_owned()));
        }
        if let Some((scheme, _)) = address.split_once("://") {
            return Err(Error::invalid(
                "address",
                format!(
                    "unknown scheme {scheme:?} in {address:?} \
                     (host:port, http://host:port, https://host:port or unix:/path)"
                ),
            ));
        }
        if address.is_empty() || !address.contains(':') {
            return Err(Error::invalid(
                "address",
                format!(
                    "{address:?} is not an address \
                     (host:port, http://host:port, https://host:port or unix:/path)"
                ),
            ));
        }
        Ok(Address::Plain(format!("http://{address}")))
    }
}

/// TLS settings for `https://` addresses.
#[derive(Debug, Clone, Default)]
pub(crate) struct TlsOptions {
    /// PEM certificates of the authorities to trust; none: the Mozilla roots (webpki-roots).
    pub(crate) ca_pem: Vec<Vec<u8>>,
    /// The name the server's certificate must carry (the address's host by default).
    pub(crate) domain: Option<String>,
}

/// Opens a channel to `address`. Plain TCP and Unix-socket connections send each request in one
/// write ([`Coalescing`]); TLS connections use tonic's connector.
pub(crate) async fn open_channel(
    address: &Address,
    connect_timeout: Option<Duration>,
    tls: &TlsOptions,
) -> Result<Channel> {
    let configure = |endpoint: Endpoint| match connect_timeout {
        Some(timeout) => endpoint.connect_timeout(timeout),
        None => endpoint,
    };
    let unreachable = |what: &str, error: tonic::transport::Error| {
        let mut message = format!("cannot connect to {what}: {error}");
        let mut source = std::error::Error::source(&error);
        while let Some(cause) = source {
            message.push_str(&format!(": {cause}"));
            source = cause.source();
        }
        Error::new(Code::Unavailable, message)
    };
    match address {
        Address::Unix(path) => {
            // The endpoint's URI is required by the HTTP/2 layer but not used to connect.
            let socket = path.clone();
            configure(Endpoint::from_static("http://localhost"))
                .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
                    let socket = socket.clone();
                    async move {
                        let stream = tokio::net::UnixStream::connect(socket).await?;
                        Ok::<_, std::io::Error>(TokioIo::new(Coalescing::new(stream)))
                    }
                }))
                .await
                .map_err(|e| unreachable(&format!("unix:{}", path.display()), e))
        }
        Address::Plain(uri) => {
            let endpoint = Endpoint::from_shared(uri.clone())
                .map_err(|e| Error::invalid("address", format!("{uri:?}: {e}")))?;
            configure(endpoint)
                .connect_with_connector(tower::service_fn(
                    |uri: tonic::transport::Uri| async move {
                        let host = uri.host().unwrap_or("localhost");
                        // IPv6 literals come bracketed in the URI; `connect` wants them bare.
                        let host = host.trim_start_matches('[').trim_end_matches(']');
                        let port = uri.port_u16().unwrap_or(80);
                        let stream = tokio::net::TcpStream::connect((host, port)).await?;
                        stream.set_nodelay(true)?;
                        Ok::<_, std::io::Error>(TokioIo::new(Coalescing::new(stream)))
                    },
                ))
                .await
                .map_err(|e| unreachable(uri, e))
        }
        Address::Tls(uri) => {
            let mut config = ClientTlsConfig::new();
            if tls.ca_pem.is_empty() {
                config = config.with_webpki_roots();
            }
            for pem in &tls.ca_pem {
                config = config.ca_certificate(Certificate::from_pem(pem));
            }
            if let Some(domain) = &tls.domain {
                config = config.domain_name(domain.clone());
            }
            let endpoint = Endpoint::from_shared(uri.clone())
                .map_err(|e| Error::invalid("address", format!("{uri:?}: {e}")))?
                .tls_config(config)
                .map_err(|e| Error::invalid("tls", e))?;
            configure(endpoint)
                .connect()
                .await
                .map_err(|e| unreachable(uri, e))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_documented_address_form_parses() {
        assert_eq!(
            Address::parse("127.0.0.1:50051"),
            Ok(Address::Plain("http://127.0.0.1:50051".into()))
        );
        assert_eq!(
            Address::parse("localhost:50051"),
            Ok(Address::Plain("http://localhost:50051".into()))
        );
        assert_eq!(
            Address::parse("[::1]:50051"),
            Ok(Address::Plain("http://[::1]:50051".into()))
        );
        assert_eq!(
            Address::parse("http://db:1"),
            Ok(Address::Plain("http://db:1".into()))
        );
        assert_eq!(
            Address::parse("https://db:1"),
            Ok(Address::Tls("https://db:1".into()))
        );
        assert_eq!(
            Address::parse("unix:/run/tarn.sock"),
            Ok(Address::Unix("/run/tarn.sock".into()))
        );
    }

    #[test]
    fn bad_addresses_are_refused_naming_the_field() {
        for bad in ["", "unix:", "ftp://db:1", "localhost"] {
            let error = Address::parse(bad).unwrap_err();
            assert_eq!(error.code(), Code::InvalidArgument, "{bad}");
            assert!(error.message().starts_with("address:"), "{bad}: {error}");
        }
    }
}
