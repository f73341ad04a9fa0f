"""Link-adaptive codec choice: the most accurate codec whose predicted push time fits a share of the sync interval."""

from __future__ import annotations

import time
from collections.abc import Callable

from geofed_hpc.config import CodecConfig
from geofed_hpc.log import logger

# Bits per parameter assumed for a codec until this site has pushed with it (the symbol width: an upper
# bound, since zstd only shrinks symbols); measured sizes replace them.
PRIOR_BITS = {
    **{"fp32": 32.0, "bf16": 16.0, "int16": 16.0, "int8": 8.0, "int4": 4.0, "int2": 2.0, "paper_int8": 8.0},
    "sparse": 1.0,  # 2-bit values and 16-bit gaps at density 1/16 (a bound for the default 1/64)
}
HEADROOM = 0.8  # moving to a more accurate codec needs its predicted time under this share of the budget


class LinkAdaptive:
    """Measures push throughput (an exponential average) and picks the codec for each push.

    Until a measurement exists (the first push after joining) the cheapest codec is used: that push is the
    probe of the link, and error feedback carries what it lost into the next push. A `probe` with a separate
    transfer seeds the rate directly.
    """

    def __init__(self, cfg: CodecConfig, site: str = "site", clock: Callable[[], float] = time.monotonic) -> None:
        self.codecs = list(cfg.adaptive_codecs)
        self.clock = clock
        self._last_push: float | None = None  # when the last push finished (the interval when none is set)
        self.fraction = cfg.adaptive_fraction
        self.alpha = cfg.adaptive_ema
        self.site = site
        self.rate: float | None = None  # bytes per second
        self.bits = {c: PRIOR_BITS[c] for c in self.codecs}
        self._sized: set[str] = set()  # codecs whose bits per parameter were measured (not the prior)
        self.current: str | None = None

    def probe(self, nbytes: int, seconds: float) -> None:
        """Seed (or reset) the rate from one measured transfer."""
        if nbytes > 0 and seconds > 0:
            self.rate = nbytes / seconds

    def observe(self, codec: str, nbytes: int, numel: int, seconds: float) -> None:
        """Fold in one finished push: its size (for the codec's bits per parameter) and its throughput."""
        self._last_push = self.clock()
        if numel > 0 and codec in self.bits:
            bits = 8.0 * nbytes / numel
            self.bits[codec] += (self.alpha if codec in self._sized else 1.0) * (bits - self.bits[codec])
            self._sized.add(codec)
        if nbytes <= 0 or seconds <= 0:
            return
        sample = nbytes / seconds
        self.rate = sample if self.rate is None else self.rate + self.alpha * (sample - self.rate)

    def predict(self, codec: str, numel: int) -> float:
        """Seconds a push of `numel` parameters with `codec` should take at the measured rate."""
        assert self.rate is not None
        return self.bits[codec] * numel / 8.0 / self.rate

    def choose(self, numel: int, interval_s: float = 0.0) -> str:
        """The codec for the next push of `numel` parameters when pushes come every `interval_s` seconds
        (0: no wall-clock interval is set, so the time since the last push stands for it)."""
        if interval_s <= 0 and self._last_push is not None:
            interval_s = self.clock() - self._last_push
        pick = self.codecs[-1]
        budget = self.fraction * interval_s
        if self.rate is not None and budget > 0:
            for c in self.codecs:
                current = self.current if self.current in self.codecs else self.codecs[-1]
                allowed = budget * (HEADROOM if self.codecs.index(c) < self.codecs.index(current) else 1.0)
                if self.predict(c, numel) <= allowed:
                    pick = c
                    break
        if pick != self.current:
            if self.rate is None:
                why = "no push measured yet: probing the link with the cheapest codec"
            else:
                why = (
                    f"measured push rate {self.rate / 1e6:.3g} MB/s, predicted {self.predict(pick, numel):.3g}s "
                    f"of {budget:.3g}s allowed ({self.fraction:g} of the {interval_s:.3g}s sync interval)"
                )
            logger.info("%s: codec %s -> %s (%s)", self.site, self.current or "none", pick, why)
            self.current = pick
        return pick
