"""PII: replace e-mail and IP addresses (and phone numbers) with placeholders; never removes a document.

As in FineWeb (datatrove's `PIIFormatter`), only publicly routable IP addresses are replaced by
default: private, loopback, link-local and documentation addresses (192.168.1.1, 127.0.0.1,
10.0.0.0/8, 2001:db8::/32, ...) identify nobody and are what networking tutorials are made of.
IPv4 needs four dot-separated octets of 0-255 without leading zeros, standing alone: `1.2.3`,
`1.2.3.4.5` and `256.1.1.1` are not addresses. IPv6 candidates are validated by `ipaddress`.

Phone numbers (off by default, as FineWeb has no phone rule; `phone = true`) are matched in
three shapes, each standing alone (no digit, letter, `.`, `/` or `-` touching it): international,
`+` and a 1-3 digit country code then groups of digits (8-15 digits in all, E.164's limit), e.g.
`+44 20 7946 0958`, `+1 (555) 123-4567`, `+33 1 23 45 67 89`; North American `(555) 123-4567`,
`555-123-4567`, `555.123.4567`; national numbers with a trunk 0 and separated groups (9-12
digits), e.g. `020 7946 0958`, `030 1234 5678`, `01 23 45 67 89`, `07700 900123`. Dates
(`05-12-2020` has 8 digits), years (`1990-2000`), version strings, prices and long digit runs
without separators are not phone numbers.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from kiln.data.pipeline.document import Document

# Local part: the common unquoted characters; it must start at a word boundary (not inside a
# longer token) and is at most 64 characters (RFC 5321), which bounds regex backtracking.
# Domain: dot-separated labels of letters/digits/hyphens ending in an alphabetic TLD, so
# "a@b", "user@localhost" and "pkg@1.2.3" are not addresses.
_EMAIL = re.compile(
    r"(?<![\w.%+-])[\w.%+-]{1,64}@"
    r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)+[A-Za-z]{2,63}"
    r"(?![\w-]|\.[A-Za-z0-9])"
)
_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
# Not preceded by a digit, a dot or a letter, not followed by more digits or dotted numbers.
_IPV4 = re.compile(rf"(?<![\w.]){_OCTET}(?:\.{_OCTET}){{3}}(?!\.?\d|\w)")
_IPV4_CANDIDATE = re.compile(r"[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}\.[0-9]")
_SEP = r"[ .\-]?"
_PHONE = re.compile(
    r"(?<![\w.+/-])(?:"
    r"\+\d{1,3}(?:[ .\-]?\(\d{1,4}\)|[ .\-]?\d{1,4}){2,6}"  # +CC, then groups
    r"|\(\d{3}\)[ ]?\d{3}[ .\-]\d{4}|\d{3}([.\-])\d{3}\1\d{4}"  # North American
    r"|0\d{1,4}(?:[ .\-]\d{2,4}){2,4}|0\d{1,4}[ \-]\d{5,8}"  # national, trunk 0
    r")(?![\w]|[.\-/]\d)"
)
# Candidates only: hex groups with at least two colons; `ipaddress` decides.
_IPV6 = re.compile(r"(?<![\w:.])(?:[0-9A-Fa-f]{0,4}:){2,7}[0-9A-Fa-f]{0,4}(?![\w:])")


@dataclass(frozen=True)
class PIIConfig:
    """What to redact and with what; defaults follow FineWeb's PIIFormatter (public IPs only)."""

    enabled: bool = True
    email: bool = True
    ip: bool = True
    public_ips_only: bool = True
    phone: bool = False  # not in FineWeb's PIIFormatter; see the module docstring
    email_placeholder: str = "<EMAIL>"
    ip_placeholder: str = "<IP>"
    phone_placeholder: str = "<PHONE>"


class PIIRedact:
    """Replace addresses in place and count them in `meta["pii"]`; always keeps the document."""

    name = "pii"

    def __init__(self, config: PIIConfig) -> None:
        self.config = config

    def redact(self, text: str) -> tuple[str, int, int]:
        """`text` with addresses replaced, and how many e-mail and IP addresses there were."""
        cfg = self.config
        emails = ips = 0
        if cfg.email and "@" in text:
            text, emails = _EMAIL.subn(cfg.email_placeholder, text)
        if cfg.ip:
            if _IPV4_CANDIDATE.search(text):  # a plain character-class scan: 2x faster
                text, n = self._replace_ips(_IPV4, text)
                ips += n
            if "::" in text or text.count(":") >= 7:  # an IPv6 address has "::" or 7 colons
                text, n = self._replace_ips(_IPV6, text)
                ips += n
        return text, emails, ips

    def redact_phones(self, text: str) -> tuple[str, int]:
        """`text` with phone numbers replaced, and how many there were."""
        count = 0
        placeholder = self.config.phone_placeholder

        def replace(match: re.Match[str]) -> str:
            nonlocal count
            found = match.group()
            digits = sum(c.isdigit() for c in found)
            low = 8 if found.startswith("+") else 9 if found.startswith("0") else 10
            if not low <= digits <= 15:
                return found
            count += 1
            return placeholder

        return _PHONE.sub(replace, text), count

    def _replace_ips(self, pattern: re.Pattern[str], text: str) -> tuple[str, int]:
        count = 0
        public_only = self.config.public_ips_only
        placeholder = self.config.ip_placeholder

        def replace(match: re.Match[str]) -> str:
            nonlocal count
            found = match.group()
            try:
                address = ipaddress.ip_address(found)
            except ValueError:
                return found
            if public_only and not address.is_global:
                return found
            count += 1
            return placeholder

        return pattern.sub(replace, text), count

    def apply(self, doc: Document) -> None:
        """Redact `doc.text`; record the counts in `doc.meta["pii"]`."""
        doc.text, emails, ips = self.redact(doc.text)
        doc.meta["pii"] = {"email": emails, "ip": ips}
        if self.config.phone:
            doc.text, doc.meta["pii"]["phone"] = self.redact_phones(doc.text)
        return None
