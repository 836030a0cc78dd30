//! Little-endian encoding helpers for tarn's sealed-segment files. The reader never panics on
//! short or malformed input: every read is bounds-checked and reports what was being read.

use crate::error::{IndexError, Result};

#[derive(Debug, Default)]
pub(crate) struct ByteWriter {
    pub(crate) bytes: Vec<u8>,
}

impl ByteWriter {
    pub(crate) fn u8(&mut self, v: u8) {
        self.bytes.push(v);
    }
    pub(crate) fn u16(&mut self, v: u16) {
        self.bytes.extend_from_slice(&v.to_le_bytes());
    }
    pub(crate) fn u32(&mut self, v: u32) {
        self.bytes.extend_from_slice(&v.to_le_bytes());
    }
    pub(crate) fn u64(&mut self, v: u64) {
        self.bytes.extend_from_slice(&v.to_le_bytes());
    }
    pub(crate) fn u128(&mut self, v: u128) {
        self.bytes.extend_from_slice(&v.to_le_bytes());
    }
    pub(crate) fn f32s(&mut self, values: &[f32]) {
        self.bytes.reserve(values.len() * 4);
        for v in values {
            self.bytes.extend_from_slice(&v.to_le_bytes());
        }
    }
    pub(crate) fn u32s(&mut self, values: &[u32]) {
        self.bytes.reserve(values.len() * 4);
        for v in values {
            self.bytes.extend_from_slice(&v.to_le_bytes());
        }
    }
    pub(crate) fn u64s(&mut self, values: &[u64]) {
        for v in values {
            self.u64(*v);
        }
    }
}

#[derive(Debug)]
pub(crate) struct ByteReader<'a> {
    bytes: &'a [u8],
    offset: usize,
}

impl<'a> ByteReader<'a> {
    pub(crate) fn new(bytes: &'a [u8]) -> Self {
        ByteReader { bytes, offset: 0 }
    }

    pub(crate) fn remaining(&self) -> usize {
        self.bytes.len() - self.offset
    }

    /// Bytes read so far.
    pub(crate) fn offset(&self) -> usize {
        self.offset
    }

    pub(crate) fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(IndexError::Format(format!(
                "{what}: needs {n} bytes at offset {}, {} left",
                self.offset,
                self.remaining()
            )));
        }
        let slice = &self.bytes[self.offset..self.offset + n];
        self.offset += n;
        Ok(slice)
    }

    pub(crate) fn u8(&mut self, what: &str) -> Result<u8> {
        Ok(self.take(1, what)?[0])
    }
    pub(crate) fn u16(&mut self, what: &str) -> Result<u16> {
        let b = self.take(2, what)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    pub(crate) fn u32(&mut self, what: &str) -> Result<u32> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    pub(crate) fn u64(&mut self, what: &str) -> Result<u64> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8, what)?);
        Ok(u64::from_le_bytes(a))
    }
    pub(crate) fn u128(&mut self, what: &str) -> Result<u128> {
        let mut a = [0u8; 16];
        a.copy_from_slice(self.take(16, what)?);
        Ok(u128::from_le_bytes(a))
    }
    /// `count` elements of `size` bytes each, checked against what is left before allocating.
    fn array(&mut self, count: usize, size: usize, what: &str) -> Result<&'a [u8]> {
        let n = count
            .checked_mul(size)
            .ok_or_else(|| IndexError::Format(format!("{what}: count {count} overflows")))?;
        self.take(n, what)
    }
    pub(crate) fn f32s(&mut self, count: usize, what: &str) -> Result<Vec<f32>> {
        let raw = self.array(count, 4, what)?;
        let mut values = crate::simd::huge_page_vec(count);
        values.extend(
            raw.chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        );
        Ok(values)
    }
    pub(crate) fn u32s(&mut self, count: usize, what: &str) -> Result<Vec<u32>> {
        let raw = self.array(count, 4, what)?;
        Ok(raw
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }
    pub(crate) fn u64s(&mut self, count: usize, what: &str) -> Result<Vec<u64>> {
        let raw = self.array(count, 8, what)?;
        Ok(raw
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
            .collect())
    }
    pub(crate) fn u128s(&mut self, count: usize, what: &str) -> Result<Vec<u128>> {
        let raw = self.array(count, 16, what)?;
        Ok(raw
            .chunks_exact(16)
            .map(|c| u128::from_le_bytes(c.try_into().expect("16 bytes")))
            .collect())
    }
}
