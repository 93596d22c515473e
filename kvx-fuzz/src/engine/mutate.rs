//! The mutations: a seeded generator and the edits it makes, aimed at the formats kvx decodes
//! (MessagePack markers and length fields, JSON numbers and nesting).

/// A xorshift64* generator: small, fast, and the same sequence for the same seed everywhere.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator from `seed` (any value, zero included).
    pub fn new(seed: u64) -> Self {
        Rng(splitmix64(seed) | 1)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A number in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 { 0 } else { (self.next_u64() % n as u64) as usize }
    }

    /// True once in `n` times on average.
    pub fn one_in(&mut self, n: usize) -> bool {
        self.below(n) == 0
    }
}

pub(super) fn splitmix64(seed: u64) -> u64 {
    let mut z = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// FNV-1a, for naming crash files by content and deriving per-target seeds.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3))
}

/// Bytes that mean something to MessagePack or JSON.
const INTERESTING_BYTES: &[u8] = &[
    0x00, 0x01, 0x7f, 0x80, 0xff, // edges
    0xc0, 0xc2, 0xc3, // nil, false, true
    0x80, 0x8f, 0x90, 0x9f, 0xa0, 0xbf, // fixmap, fixarray, fixstr
    0xc4, 0xc5, 0xc6, 0xd9, 0xda, 0xdb, // bin 8/16/32, str 8/16/32
    0xdc, 0xdd, 0xde, 0xdf, // array 16/32, map 16/32
    0xcc, 0xcd, 0xce, 0xcf, 0xd0, 0xd3, 0xca, 0xcb, 0xe0, // uints, ints, floats, negative fixint
    b'[', b']', b'{', b'}', b'"', b',', b':', b'-', b'0', b'9', b'\\', b'e', b'.', // JSON
];

const INTERESTING_INTS: &[u64] = &[
    0,
    1,
    2,
    15,
    16,
    0x7f,
    0x80,
    0xff,
    0x100,
    0x7fff,
    0x8000,
    0xffff,
    0x1_0000,
    0x7fff_ffff,
    0x8000_0000,
    0xffff_fffe,
    0xffff_ffff,
    0x1_0000_0000,
    0x7fff_ffff_ffff_ffff,
    0x8000_0000_0000_0000,
    u64::MAX - 1,
    u64::MAX,
];

const INTERESTING_DECIMALS: &[&str] = &[
    "0",
    "-0",
    "1",
    "-1",
    "15",
    "16",
    "17",
    "255",
    "256",
    "65535",
    "65536",
    "70000",
    "2147483648",
    "4294967295",
    "4294967296",
    "9007199254740993",
    "9223372036854775808",
    "18446744073709551615",
    "18446744073709551616",
    "-9223372036854775809",
    "99999999999999999999999999999999999999",
    "1e999",
    "-1e999",
    "1.5",
    "1e-400",
    "0.0",
];

/// Mutates inputs: byte flips, inserts, deletes, duplications, splices between corpus entries,
/// interesting integers, MessagePack length-field edits, JSON number edits and dictionary tokens.
#[derive(Debug)]
pub struct Mutator<'a> {
    rng: Rng,
    dict: &'a [Vec<u8>],
    max_len: usize,
}

impl<'a> Mutator<'a> {
    /// A mutator drawing from `seed`, with the target's dictionary; inputs stay under `max_len`.
    pub fn new(seed: u64, dict: &'a [Vec<u8>], max_len: usize) -> Self {
        Mutator { rng: Rng::new(seed), dict, max_len: max_len.max(1) }
    }

    /// The generator (to pick corpus entries with the same stream).
    pub fn rng(&mut self) -> &mut Rng {
        &mut self.rng
    }

    /// Applies one or more stacked mutations to `buf` (each further one with probability 1/3);
    /// `pool` supplies splice partners.
    pub fn mutate(&mut self, buf: &mut Vec<u8>, pool: &[Vec<u8>]) {
        loop {
            self.mutate_once(buf, pool);
            if !self.rng.one_in(3) || buf.len() > self.max_len {
                break;
            }
        }
        buf.truncate(self.max_len);
    }

    fn pos(&mut self, buf: &[u8]) -> usize {
        self.rng.below(buf.len())
    }

    /// A position to insert at (`0..=len`).
    fn gap(&mut self, buf: &[u8]) -> usize {
        self.rng.below(buf.len() + 1)
    }

    fn mutate_once(&mut self, buf: &mut Vec<u8>, pool: &[Vec<u8>]) {
        let room = self.max_len.saturating_sub(buf.len());
        match self.rng.below(15) {
            0 if !buf.is_empty() => {
                let i = self.pos(buf);
                buf[i] ^= 1 << self.rng.below(8);
            }
            1 if !buf.is_empty() => {
                let i = self.pos(buf);
                buf[i] = self.rng.next_u64() as u8;
            }
            2 if !buf.is_empty() => {
                let i = self.pos(buf);
                buf[i] = INTERESTING_BYTES[self.rng.below(INTERESTING_BYTES.len())];
            }
            3 if room > 0 => {
                let n = (1 + self.rng.below(8)).min(room);
                let at = self.gap(buf);
                let bytes: Vec<u8> = (0..n).map(|_| self.rng.next_u64() as u8).collect();
                buf.splice(at..at, bytes);
            }
            4 if room > 0 => {
                // A run of one byte: nesting (`[[[[`, 0x91 0x91 ..), padding, long strings.
                let longest = if self.rng.one_in(8) { 2048 } else { 64 };
                let n = (1 + self.rng.below(longest)).min(room);
                let b = if buf.is_empty() || self.rng.one_in(2) {
                    INTERESTING_BYTES[self.rng.below(INTERESTING_BYTES.len())]
                } else {
                    buf[self.pos(buf)]
                };
                let at = self.gap(buf);
                buf.splice(at..at, std::iter::repeat_n(b, n));
            }
            5 if !buf.is_empty() => {
                let at = self.pos(buf);
                let max = if self.rng.one_in(4) { buf.len() - at } else { 16.min(buf.len() - at) };
                let n = 1 + self.rng.below(max);
                buf.drain(at..at + n);
            }
            6 if !buf.is_empty() && room > 0 => {
                let from = self.pos(buf);
                let n = (1 + self.rng.below(buf.len() - from)).min(room).min(256);
                let chunk = buf[from..from + n].to_vec();
                let at = self.gap(buf);
                if self.rng.one_in(2) {
                    buf.splice(at..at, chunk);
                } else {
                    let end = (at + n).min(buf.len());
                    buf.splice(at..end, chunk);
                }
            }
            7 if !buf.is_empty() => self.overwrite_int(buf),
            8 if !buf.is_empty() => {
                let i = self.pos(buf);
                let delta = 1 + self.rng.below(16) as u8;
                buf[i] =
                    if self.rng.one_in(2) { buf[i].wrapping_add(delta) } else { buf[i].wrapping_sub(delta) };
            }
            9 => self.edit_msgpack_length(buf),
            10 if !pool.is_empty() => {
                let other = &pool[self.rng.below(pool.len())];
                let cut = self.gap(buf);
                let from = self.rng.below(other.len() + 1);
                buf.truncate(cut);
                buf.extend_from_slice(&other[from..]);
            }
            11 if !self.dict.is_empty() => {
                let dict = self.dict;
                let token = &dict[self.rng.below(dict.len())];
                let at = self.gap(buf);
                if self.rng.one_in(2) && token.len() <= room {
                    buf.splice(at..at, token.iter().copied());
                } else {
                    let end = (at + token.len()).min(buf.len());
                    buf.splice(at..end, token.iter().copied());
                }
            }
            12 => self.edit_decimal(buf),
            13 if !buf.is_empty() => {
                let n = self.rng.below(buf.len());
                buf.truncate(n);
            }
            _ => {
                if buf.is_empty() {
                    buf.push(self.rng.next_u64() as u8);
                } else {
                    let i = self.pos(buf);
                    buf[i] = !buf[i];
                }
            }
        }
    }

    /// Writes an interesting integer, 1, 2, 4 or 8 bytes wide, big- (MessagePack) or little-endian.
    fn overwrite_int(&mut self, buf: &mut [u8]) {
        let width = [1, 2, 4, 8][self.rng.below(4)].min(buf.len());
        let mut v = INTERESTING_INTS[self.rng.below(INTERESTING_INTS.len())];
        if self.rng.one_in(4) {
            v = v.wrapping_add(self.rng.below(3) as u64).wrapping_sub(1);
        }
        // The value's low `width` bytes, in either byte order.
        let (le, be) = (v.to_le_bytes(), v.to_be_bytes());
        let src = if self.rng.one_in(4) { &le[..width] } else { &be[8 - width..] };
        let at = self.rng.below(buf.len() - width + 1);
        buf[at..at + width].copy_from_slice(src);
    }

    /// Finds a MessagePack container or string marker and gives it another length: the length
    /// field of a sized marker, the low bits of a fix marker, or a fix marker widened to its
    /// 32-bit form with a huge length.
    fn edit_msgpack_length(&mut self, buf: &mut Vec<u8>) {
        let markers: Vec<usize> = (0..buf.len())
            .filter(|&i| matches!(buf[i], 0x80..=0xbf | 0xc4..=0xc6 | 0xd9..=0xdb | 0xdc..=0xdf))
            .collect();
        if markers.is_empty() {
            return;
        }
        let at = markers[self.rng.below(markers.len())];
        let len = INTERESTING_INTS[self.rng.below(INTERESTING_INTS.len())];
        let field = match buf[at] {
            0xc4 | 0xd9 => 1,
            0xc5 | 0xda | 0xdc | 0xde => 2,
            0xc6 | 0xdb | 0xdd | 0xdf => 4,
            fix => {
                if self.rng.one_in(2) {
                    let (mask, wide) = match fix {
                        0x80..=0x8f => (0x0f, 0xdf),
                        0x90..=0x9f => (0x0f, 0xdd),
                        _ => (0x1f, 0xdb),
                    };
                    buf[at] = (fix & !mask) | (self.rng.next_u64() as u8 & mask);
                    if self.rng.one_in(2) {
                        let huge = [wide, 0xff, 0xff, 0xff, self.rng.next_u64() as u8];
                        buf.splice(at..at + 1, huge);
                    }
                } else {
                    let delta = self.rng.below(3) as u8;
                    buf[at] =
                        if self.rng.one_in(2) { fix.wrapping_add(delta) } else { fix.wrapping_sub(delta) };
                }
                return;
            }
        };
        let end = (at + 1 + field).min(buf.len());
        let bytes = len.to_be_bytes();
        let n = end - (at + 1);
        buf[at + 1..end].copy_from_slice(&bytes[8 - n..]);
    }

    /// Replaces a run of ASCII digits (a JSON number) with an interesting decimal.
    fn edit_decimal(&mut self, buf: &mut Vec<u8>) {
        let starts: Vec<usize> = (0..buf.len())
            .filter(|&i| buf[i].is_ascii_digit() && (i == 0 || !buf[i - 1].is_ascii_digit()))
            .collect();
        let decimal = INTERESTING_DECIMALS[self.rng.below(INTERESTING_DECIMALS.len())].as_bytes();
        if starts.is_empty() {
            let at = self.gap(buf);
            buf.splice(at..at, decimal.iter().copied());
            return;
        }
        let start = starts[self.rng.below(starts.len())];
        let end = (start..buf.len()).find(|&i| !buf[i].is_ascii_digit()).unwrap_or(buf.len());
        buf.splice(start..end, decimal.iter().copied());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_generator_is_deterministic_and_spreads() {
        let a: Vec<u64> = {
            let mut r = Rng::new(7);
            (0..4).map(|_| r.next_u64()).collect()
        };
        let mut r = Rng::new(7);
        assert_eq!(a, (0..4).map(|_| r.next_u64()).collect::<Vec<_>>());
        assert_ne!(Rng::new(0).next_u64(), 0);
        let mut seen = [false; 10];
        for _ in 0..1000 {
            seen[r.below(10)] = true;
        }
        assert!(seen.iter().all(|s| *s));
    }

    #[test]
    fn mutations_stay_under_the_length_cap_and_change_the_input() {
        let pool = vec![b"{\"remote_block_ids\":[[1,2,3]]}".to_vec(), vec![0x92, 0xa1, b'a', 0xc4, 2, 1, 2]];
        let dict = [b"null".to_vec()];
        let mut m = Mutator::new(1, &dict, 64);
        let mut changed = 0;
        for i in 0..5000 {
            let mut buf = pool[i % 2].clone();
            m.mutate(&mut buf, &pool);
            assert!(buf.len() <= 64);
            changed += usize::from(buf != pool[i % 2]);
        }
        assert!(changed > 4000, "{changed}");
    }

    #[test]
    fn msgpack_length_edits_touch_length_fields() {
        let mut m = Mutator::new(3, &[], 1 << 10);
        let orig = vec![0xc6, 0, 0, 0, 2, 7, 7];
        let mut saw_huge = false;
        for _ in 0..200 {
            let mut buf = orig.clone();
            m.edit_msgpack_length(&mut buf);
            saw_huge |= buf[1..5] == [0xff, 0xff, 0xff, 0xff];
        }
        assert!(saw_huge);
    }
}
