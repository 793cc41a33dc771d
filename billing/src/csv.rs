//! CSV as every Cachet export writes it (RFC 4180, CRLF line ends).

/// One field per RFC 4180: quoted when it holds a comma, quote, CR or LF; quotes doubled.
pub fn field(s: &str) -> std::borrow::Cow<'_, str> {
    if s.contains([',', '"', '\r', '\n']) {
        format!("\"{}\"", s.replace('"', "\"\"")).into()
    } else {
        s.into()
    }
}
