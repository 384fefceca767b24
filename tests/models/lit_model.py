"""A LightningModule around the odd model (tests of `consolidate --format lightning`, issue 14)."""
import lightning as L
import torch

from odd_model import OddLM


class LitOdd(L.LightningModule):
    def __init__(self, lr: float = 3e-3, note: str = "odd"):
        super().__init__()
        self.save_hyperparameters()
        self.model = OddLM()

    def forward(self, tokens):
        return self.model(tokens)

    def training_step(self, batch, batch_idx):
        return self.model(batch)

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.hparams.lr)


def batches(n: int = 8):
    gen = torch.Generator().manual_seed(3)
    return torch.utils.data.DataLoader([torch.randint(0, 101, (9,), generator=gen) for _ in range(n)], batch_size=2)
