"""The static options of context attention, passed as one argument (and one
hashable `nondiff_argnums` entry of the custom VJPs): `ContextOptions`, the
tiles' options (`_flash_tile.TileOptions`) plus the mesh axis and the layout."""

import dataclasses

from ._flash_tile import TileOptions


@dataclasses.dataclass(frozen=True)
class ContextOptions:
    """What every context-attention strategy needs: the manual mesh `axis` that
    splits the sequence, whether its layout is `load_balanced`, and the tiles'
    options."""

    axis: str
    load_balanced: bool
    causal: bool
    block_size: int
    dropout_rate: float

    @property
    def positional(self) -> bool:
        """Whether global positions matter (the causal mask, dropout's hash);
        without them every device's sequence is one chunk."""
        return self.causal or self.dropout_rate > 0

    @property
    def chunked(self) -> bool:
        """Whether a device's sequence is two chunks of the global one (the
        load-balanced layout, where positions matter) rather than one."""
        return self.load_balanced and self.positional

    @property
    def tiles(self) -> TileOptions:
        return TileOptions(self.causal, self.block_size, self.dropout_rate)
