//! [`ByteSource`]: fuzz bytes read as choices, for targets that build structured inputs.

/// Reads choices out of fuzz bytes. Once the bytes run out every read is 0, so the first option
/// of each choice is the default: an input of plain corpus bytes takes the "natural" path, and
/// the fuzzer reaches the edge cases by mutating the bytes that pick them.
#[derive(Debug, Clone)]
pub struct ByteSource<'a> {
    data: &'a [u8],
}

impl<'a> ByteSource<'a> {
    /// Choices read from `data`.
    pub fn new(data: &'a [u8]) -> Self {
        ByteSource { data }
    }

    /// Whether the bytes are used up.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// The next byte, or 0.
    pub fn u8(&mut self) -> u8 {
        match self.data.split_first() {
            Some((&b, rest)) => {
                self.data = rest;
                b
            }
            None => 0,
        }
    }

    /// The next 4 bytes, little-endian (missing bytes are 0).
    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.u8(), self.u8(), self.u8(), self.u8()])
    }

    /// The next 8 bytes, little-endian (missing bytes are 0).
    pub fn u64(&mut self) -> u64 {
        u64::from(self.u32()) | (u64::from(self.u32()) << 32)
    }

    /// A number in `0..n` from one byte (0 when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 { 0 } else { usize::from(self.u8()) % n }
    }

    /// Up to `max` bytes, the count taken from one byte.
    pub fn bytes(&mut self, max: usize) -> &'a [u8] {
        let n = self.below(max + 1).min(self.data.len());
        let (head, rest) = self.data.split_at(n);
        self.data = rest;
        head
    }

    /// A short string (lossy UTF-8 of up to `max` bytes).
    pub fn string(&mut self, max: usize) -> String {
        String::from_utf8_lossy(self.bytes(max)).into_owned()
    }

    /// An edge value (0, 1, a power of two's neighbours, the maximum) or, for the last choice,
    /// 8 arbitrary bytes.
    pub fn edgy_u64(&mut self) -> u64 {
        const EDGES: [u64; 12] =
            [0, 1, 2, 15, 16, 255, 256, 0xffff, 0xffff_ffff, 0x1_0000_0000, u64::MAX / 2, u64::MAX];
        match self.below(EDGES.len() + 1) {
            i if i < EDGES.len() => EDGES[i],
            _ => self.u64(),
        }
    }

    /// As [`edgy_u64`](Self::edgy_u64), cut to 32 bits.
    pub fn edgy_u32(&mut self) -> u32 {
        match self.edgy_u64() {
            v if v > u64::from(u32::MAX) => u32::MAX,
            v => v as u32,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_choices_then_zeroes() {
        let mut s = ByteSource::new(&[7, 1, 0, 0, 0, 3, b'a', b'b', b'c']);
        assert_eq!(s.below(5), 2);
        assert_eq!(s.u32(), 1);
        assert_eq!(s.string(10), "abc");
        assert!(s.is_empty());
        assert_eq!((s.u8(), s.u64(), s.below(3), s.bytes(4)), (0, 0, 0, &[][..]));
        assert_eq!(s.edgy_u64(), 0);
    }
}
