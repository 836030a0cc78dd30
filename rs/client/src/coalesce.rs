//! The client's connection stream: one `write` per request instead of one per HTTP/2 frame.
//!
//! tonic's client sends a unary request as three HTTP/2 frames, produced by two tasks: HEADERS
//! by hyper's connection task, then the message's DATA and an empty END_STREAM DATA by the task
//! that pipes the request body (it waits for flow-control capacity, which the connection task
//! assigns on its next poll). The connection flushes at the end of every poll, so each request
//! took three `writev`s on the client, and each woke the server, which read part of a request
//! and went back to epoll (strace of one client's durable inserts: 3 `writev`s per request on
//! the client, 3.5 `epoll_wait`s and 2 `recvfrom`s per request on the server).
//!
//! [`Coalescing`] buffers what the connection writes and, when it flushes, first yields once to
//! the runtime (`tokio::task::yield_now`, whose wake-up is deferred until the tasks already
//! runnable have run), so the body task queues its frames and the next poll writes them all
//! together. What this costs is one pass of the runtime's run queue per flush; it is only used
//! on the client side.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Bytes buffered before a write goes out without waiting for a flush.
const MAX_BUFFERED: usize = 64 << 10;

/// A stream whose writes are buffered until a flush, and whose flushes yield once first.
pub(crate) struct Coalescing<S> {
    inner: S,
    buf: Vec<u8>,
    /// How much of `buf` is already written.
    written: usize,
    /// The yield in progress of a flush that has not written yet.
    pause: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
}

impl<S> Coalescing<S> {
    pub(crate) fn new(inner: S) -> Self {
        Coalescing {
            inner,
            buf: Vec::new(),
            written: 0,
            pause: None,
        }
    }
}

impl<S: AsyncWrite + Unpin> Coalescing<S> {
    /// Writes out everything buffered.
    fn poll_drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.written < self.buf.len() {
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, &self.buf[self.written..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.written += n;
        }
        self.buf.clear();
        self.written = 0;
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Coalescing<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Coalescing<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.buf.len() >= MAX_BUFFERED {
            ready!(this.poll_drain(cx))?;
        }
        this.buf.extend_from_slice(data);
        Poll::Ready(Ok(data.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.written < this.buf.len() {
            // Let the tasks this poll woke (a request's body) queue their frames first.
            let pause = this
                .pause
                .get_or_insert_with(|| Box::pin(tokio::task::yield_now()));
            ready!(pause.as_mut().poll(cx));
            this.pause = None;
            ready!(this.poll_drain(cx))?;
        }
        Pin::new(&mut this.inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_drain(cx))?;
        Pin::new(&mut this.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Counts the writes that reach it.
    struct CountingSink {
        data: Vec<u8>,
        writes: usize,
    }

    impl AsyncWrite for CountingSink {
        fn poll_write(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            data: &[u8],
        ) -> Poll<io::Result<usize>> {
            let this = self.get_mut();
            this.writes += 1;
            this.data.extend_from_slice(data);
            Poll::Ready(Ok(data.len()))
        }
        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn writes_go_out_together_at_a_flush_in_order() {
        let mut stream = Coalescing::new(CountingSink {
            data: Vec::new(),
            writes: 0,
        });
        stream.write_all(b"headers ").await.unwrap();
        stream.write_all(b"data ").await.unwrap();
        assert_eq!(stream.inner.writes, 0);
        stream.write_all(b"end").await.unwrap();
        stream.flush().await.unwrap();
        assert_eq!(stream.inner.writes, 1);
        assert_eq!(stream.inner.data, b"headers data end");
        stream.flush().await.unwrap();
        assert_eq!(stream.inner.writes, 1);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_large_write_goes_out_before_the_flush_and_shutdown_drains() {
        let mut stream = Coalescing::new(CountingSink {
            data: Vec::new(),
            writes: 0,
        });
        let big = vec![7u8; MAX_BUFFERED];
        stream.write_all(&big).await.unwrap();
        stream.write_all(b"x").await.unwrap();
        assert_eq!(stream.inner.writes, 1);
        stream.write_all(b"y").await.unwrap();
        stream.shutdown().await.unwrap();
        assert_eq!(stream.inner.writes, 2);
        assert_eq!(stream.inner.data.len(), MAX_BUFFERED + 2);
        assert_eq!(&stream.inner.data[MAX_BUFFERED..], b"xy");
    }

    #[tokio::test(flavor = "current_thread")]
    async fn reads_pass_through() {
        let (client, mut server) = tokio::io::duplex(64);
        let mut stream = Coalescing::new(client);
        server.write_all(b"ping").await.unwrap();
        let mut got = [0u8; 4];
        stream.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"ping");
        stream.write_all(b"pong").await.unwrap();
        stream.flush().await.unwrap();
        server.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"pong");
    }
}
