import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import adaclip_torch

x, y = load_digits(return_X_y=True)  # 1,797 handwritten digits (8x8 pixels), shipped with scikit-learn
x_train, x_test, y_train, y_test = map(torch.tensor, train_test_split(x / 16, y, random_state=0))
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x_train.float(), y_train), batch_size=64)
model, optimizer, loader = adaclip_torch.make_private(
    model, optimizer, loader, target_epsilon=3.0, delta=1e-5, epochs=20, max_grad_norm=0.1
)
for _epoch in range(20):
    for xb, yb in loader:
        torch.nn.functional.cross_entropy(model(xb), yb).backward()
        optimizer.step()
        optimizer.zero_grad()
accuracy = (model(x_test.float()).argmax(1) == y_test).float().mean().item()
print(f"test accuracy {accuracy:.3f} at epsilon {optimizer.accountant.epsilon(1e-5):.2f} (delta 1e-5)")
